"""On-disk cache of traced ModelGraphs for built-in and spec-file models.

Tracing costs seconds (importing torch alone takes about 1.5 s); a graph depends only on the
model's spec, the sequence length, the micro-batch, the dtype and the code that traces it, so
it is pickled under a key of exactly those. Looking a graph up imports no torch. Models given
as `package.module:factory` or module objects are not cached on disk (their code can change
without a visible key).

The directory is `$PARAPLAN_CACHE_DIR`, else `~/.cache/paraplan`; set `PARAPLAN_CACHE_DIR=off`
to disable the cache.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

from planner.graph import ModelGraph

CACHE_ENV = "PARAPLAN_CACHE_DIR"
SPECS_DIR = Path(__file__).resolve().parent / "zoo" / "specs"
# Sources whose change alters a traced graph; their bytes are part of every key.
_CODE_FILES = ("graph.py", "tracing.py", "layering.py", "graph_layers.py", "module_layers.py", "op_kinds.py",
               "measure.py", "eager_run.py", "models.py", "source.py", "head_attrs.py")
_CODE_DIRS = ("zoo",)


def cache_dir() -> Path | None:
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "paraplan"


def _code_digest() -> str:
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    files = [root / name for name in _CODE_FILES] + sorted(p for d in _CODE_DIRS for p in (root / d).glob("*.py"))
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _spec_bytes(model: str) -> bytes | None:
    """The spec text behind a built-in name or a spec file path; None for anything else."""
    path = Path(model)
    if model.endswith((".yaml", ".yml", ".json")):
        return path.read_bytes() if path.is_file() else None
    builtin = SPECS_DIR / f"{model}.yaml"
    return builtin.read_bytes() if builtin.is_file() else None


def cache_path(model: str, seq_len: int | None, micro_batch: int, dtype: str) -> Path | None:
    """Where the graph of this model would be cached, or None when it is not cacheable."""
    directory = cache_dir()
    spec = _spec_bytes(model) if isinstance(model, str) else None
    if directory is None or spec is None:
        return None
    digest = hashlib.sha256(spec + f"|{seq_len}|{micro_batch}|{dtype}|{_code_digest()}".encode()).hexdigest()[:24]
    return directory / f"{Path(model).stem}-{digest}.pkl"


def load(path: Path | None) -> ModelGraph | None:
    if path is None or not path.is_file():
        return None
    try:
        graph = pickle.loads(path.read_bytes())
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        return None
    return graph if isinstance(graph, ModelGraph) else None


def store(path: Path | None, graph: ModelGraph) -> None:
    """Writes atomically (temp file + rename) so concurrent processes never read half a file."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_bytes(pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(temp, path)
    except OSError:
        return
