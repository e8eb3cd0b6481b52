# Two entry points, both idempotent on a fresh machine: `make demo` and `make test`.
# TORCH_SPEC is installed before the project so pip never resolves a multi-GB CUDA build;
# bring your own torch with `make VENV=/path/to/env TORCH_SPEC=` (an existing torch is kept).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.paraplan-installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/paraplan plan --model llama3-8b --cluster h100-sxm:4x8 --global-batch 256 --seq-len 8192

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 tests

clean:
	rm -rf $(VENV) build *.egg-info
