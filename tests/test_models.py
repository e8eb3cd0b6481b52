"""resolve_model: built-in names, spec files, factories, module instances, and their errors."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.fx

from planner.errors import PlannerError, PlannerErrorKind
from planner.models import list_models, resolve_model
from planner.tracing import trace
from planner.zoo import zoo_specs
from planner.zoo.spec import Arch, parse_spec

FIXTURES = "tests.fixtures.custom_models"
META = torch.device("meta")


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _resolve_error(*args, **kwargs) -> str:
    with pytest.raises(PlannerError) as caught:
        resolve_model(*args, **kwargs)
    assert caught.value.kind == PlannerErrorKind.INVALID_INPUT
    assert "\n" not in caught.value.message and "fix:" in caught.value.message
    return caught.value.message


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a throwaway importable module with the given source; returns its name."""
    def write(source: str) -> str:
        name = f"user_models_{abs(hash(source))}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        return name
    return write


def test_list_models_is_grouped_by_family():
    names = list_models()
    assert set(names) == set(zoo_specs())
    family_order = list(Arch)
    positions = [family_order.index(zoo_specs()[name].arch) for name in names]
    assert positions == sorted(positions)
    assert names.index("gpt2") < names.index("gpt2-xl") < names.index("gpt3-125m")
    assert names.index("llama3-8b") < names.index("llama3-405b")


def test_zoo_name_resolves_to_buildable_source():
    source = resolve_model("llama3-8b")
    assert source.name == "llama3-8b" and source.default_seq_len == 8192
    assert (source.dims.hidden, source.dims.heads, source.dims.kv_heads, source.dims.vocab) == (
        4096, 32, 8, 128256)
    with torch.device("meta"):
        model = source.build(seq_len=256)
    (tokens,) = source.example_inputs(2, 256, META)
    assert tokens.shape == (2, 256) and tokens.dtype == torch.long
    assert model(tokens).shape == ()


def test_vit_inputs_are_images_and_seq_len_is_patches_plus_class_token():
    source = resolve_model("vit-h-14")
    assert source.default_seq_len == (224 // 14) ** 2 + 1
    (images,) = source.example_inputs(4, 999, META)
    assert images.shape == (4, 3, 224, 224) and images.dtype == torch.get_default_dtype()


def test_fixed_input_shapes_are_traced_as_they_are():
    # A ViT's sequence is its patches plus the class token, and a factory that takes no seq_len=
    # returns its own inputs: another --seq-len is refused, and fixed inputs of 2 sequences are
    # measured as a micro-batch of 2, so the FLOPs per sequence match the same model traced one
    # sequence at a time by the factory that takes seq_len= and micro_batch=.
    for model, fixed in (("vit-l-16", 197), (f"{FIXTURES}:fixed_tiny_gpt_factory", 64)):
        with pytest.raises(PlannerError, match=f"seq_len=100: model .* has a fixed sequence length of {fixed} tokens"):
            trace(model, seq_len=100)
    fixed = trace(f"{FIXTURES}:fixed_tiny_gpt_factory", micro_batch=1)
    fresh = trace(f"{FIXTURES}:tiny_gpt_factory", seq_len=64, micro_batch=1)
    assert (fixed.seq_len, fixed.micro_batch, fresh.micro_batch) == (64, 2, 1)
    assert fixed.fwd_flops / fixed.micro_batch == pytest.approx(fresh.fwd_flops / fresh.micro_batch, rel=1e-9)


def test_fixed_inputs_without_a_sequence_count_samples():
    # Images (2, 3, 32, 32): no token sequence, so each sample is one token (throughput in samples
    # per second), and a --seq-len is refused as meaningless rather than as another length.
    graph = trace(f"{FIXTURES}:resnet_factory")
    assert (graph.seq_len, graph.micro_batch) == (1, 2)
    with pytest.raises(PlannerError, match="seq_len=512: model .* has fixed inputs without a token sequence .* "
                                           "each sample counts as one token; leave --seq-len out"):
        trace(f"{FIXTURES}:resnet_factory", seq_len=512)


def test_unknown_name_lists_three_nearest():
    message = _resolve_error("llama3-7b")
    nearest = message.split("nearest built-in names: ")[1].split(";")[0].split(", ")
    assert len(nearest) == 3 and "llama3-8b" in nearest


def test_spec_files_yaml_and_json(tmp_path):
    fields = {"arch": "moe", "layers": 4, "hidden": 64, "heads": 8, "kv_heads": 2,
              "ffn_hidden": 96, "vocab": 100, "experts": 4, "top_k": 2, "moe_ffn_hidden": 32}
    json_path = tmp_path / "my-moe.json"
    json_path.write_text(json.dumps(fields))
    yaml_path = tmp_path / "my-moe.yaml"
    yaml_path.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()))
    for path in (json_path, yaml_path):
        source = resolve_model(str(path))
        assert source.name == "my-moe"
        assert (source.dims.experts, source.dims.top_k, source.dims.ffn_hidden) == (4, 2, 32)


def test_missing_spec_file_is_one_line_error(tmp_path):
    assert "not found" in _resolve_error(str(tmp_path / "nope.yaml"))


def test_model_spec_object_resolves():
    spec = parse_spec({"arch": "gpt", "layers": 1, "hidden": 16, "heads": 2, "vocab": 10},
                      "one-layer")
    source = resolve_model(spec)
    with torch.device("meta"):
        assert source.name == "one-layer" and _params(source.build()) > 0


def test_example_inputs_rejected_for_zoo_models():
    assert "example_inputs" in _resolve_error("gpt2", example_inputs=(torch.zeros(1, 8),))


def test_factory_with_seq_len_and_micro_batch_is_recalled_with_them():
    source = resolve_model(f"{FIXTURES}:tiny_gpt_factory")
    assert source.default_seq_len == 64  # the factory's own default
    (tokens,) = source.example_inputs(3, 128, META)
    assert tokens.shape == (3, 128) and tokens.device == META
    with torch.device("meta"):
        model = source.build(seq_len=256)
    assert model.embed.pos.num_embeddings == 256


def test_factory_with_fixed_inputs_recreates_them_as_zeros_on_the_device():
    source = resolve_model(f"{FIXTURES}:resnet_factory")
    (images,) = source.example_inputs(8, 4096, torch.device("cpu"))
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert torch.count_nonzero(images) == 0
    with torch.device("meta"):
        model = source.build()
    assert model(*source.example_inputs(8, 4096, META)).shape == (2, 10)


def test_factory_build_uses_ambient_device_and_dtype():
    source = resolve_model(f"{FIXTURES}:resnet_factory")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = source.build()
    finally:
        torch.set_default_dtype(previous)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}


def test_dynamic_factory_resolves_but_defeats_fx_symbolic_tracing():
    source = resolve_model(f"{FIXTURES}:dynamic_factory")
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(source.build())


@pytest.mark.parametrize("ref,expected", [
    (f"{FIXTURES}:not_a_module_factory", "returned int, expected an nn.Module"),
    (f"{FIXTURES}:broken_factory", "raised RuntimeError: checkpoint path /nonexistent not found"),
    (f"{FIXTURES}:resnet_factori", "has no attribute `resnet_factori` (did you mean "
                                   "`resnet_factory`?)"),
    (f"{FIXTURES}:RESNET_BATCH", "is not callable"),
    ("no_such_package.models:build", "cannot import module `no_such_package.models`"),
    (":build", "expected 'package.module:factory'"),
])
def test_factory_errors_are_one_line(ref, expected):
    assert expected in _resolve_error(ref)


def test_factory_import_failure_names_the_module(user_module):
    name = user_module("raise ImportError('needs apex\\nsecond line')\n")
    message = _resolve_error(f"{name}:build")
    assert f"cannot import module `{name}` (ImportError: needs apex)" in message


def test_factory_returning_bad_inputs_is_one_line(user_module):
    name = user_module("""
        import torch
        def build():
            return torch.nn.Linear(2, 2), "images"
    """)
    assert "expected a tensor or a tuple of tensors, got str" in _resolve_error(f"{name}:build")


@pytest.mark.parametrize("shape", [(0, 32), (2, 0)])
def test_factory_inputs_with_an_empty_dimension_are_refused(user_module, shape):
    name = user_module(f"""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Embedding(77, 8), torch.nn.Linear(8, 8)), torch.zeros({shape}, dtype=torch.long)
    """)
    assert f"input 0 has shape {shape}, with an empty dimension" in _resolve_error(f"{name}:build")


def test_a_bare_module_whose_forward_takes_more_than_tokens_needs_example_inputs(user_module):
    name = user_module("""
        import torch
        class Masked(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(77, 8)
            def forward(self, input_ids, attention_mask):
                return self.embed(input_ids) * attention_mask[..., None]
        def build():
            return Masked()
    """)
    assert _resolve_error(f"{name}:build").endswith(
        "its forward takes 2 inputs (input_ids, attention_mask), and only token ids can be made up without example "
        "inputs; fix: pass the model as (module, example_inputs), or return that pair from the factory")


def test_bare_module_starting_with_embedding_gets_token_ids(user_module):
    name = user_module("""
        import torch
        def build(**kwargs):
            return torch.nn.Sequential(torch.nn.Embedding(77, 8), torch.nn.Linear(8, 8))
    """)
    source = resolve_model(f"{name}:build")
    (tokens,) = source.example_inputs(2, 5, torch.device("cpu"))
    assert tokens.shape == (2, 5) and tokens.dtype == torch.long
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 77


def test_bare_module_without_embedding_needs_example_inputs(user_module):
    name = user_module("""
        import torch
        def build():
            return torch.nn.Linear(4, 4)
    """)
    assert "cannot infer example inputs" in _resolve_error(f"{name}:build")
    source = resolve_model(f"{name}:build", example_inputs=(torch.ones(3, 4),))
    (x,) = source.example_inputs(1, 1, META)
    assert x.shape == (3, 4) and x.device == META


def test_token_inputs_follow_the_first_module_called_not_registered(user_module):
    # The head is registered before the embedding but called after it: the forward starts with an
    # embedding, so the inputs are token ids of its vocabulary.
    name = user_module("""
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.head = torch.nn.Linear(8, 50)
                self.embed = torch.nn.Embedding(50, 8)
            def forward(self, tokens):
                return self.head(self.embed(tokens))
        def build():
            return Net()
    """)
    (tokens,) = resolve_model(f"{name}:build").example_inputs(2, 5, torch.device("cpu"))
    assert tokens.shape == (2, 5) and tokens.dtype == torch.long and int(tokens.max()) < 50


def test_factory_taking_only_micro_batch(user_module):
    name = user_module("""
        import torch
        def build(micro_batch):
            return torch.nn.Linear(4, 4), (torch.zeros(micro_batch, 4),)
    """)
    source = resolve_model(f"{name}:build")
    assert source.example_inputs(6, 100, META)[0].shape == (6, 4)
    # Its inputs follow the micro-batch, not the sequence length.
    assert source.fixed_by and source.fixed_micro_batch == 0


def test_factory_taking_only_seq_len_fixes_the_batch(user_module):
    name = user_module("""
        import torch
        def build(seq_len=32):
            return torch.nn.Embedding(10, 4), (torch.zeros(3, seq_len, dtype=torch.long),)
    """)
    source = resolve_model(f"{name}:build")
    assert (source.fixed_by, source.fixed_micro_batch, source.default_seq_len) == ("", 3, 32)


def test_example_inputs_rejected_when_factory_returns_its_own():
    message = _resolve_error(f"{FIXTURES}:resnet_factory", example_inputs=(torch.zeros(1),))
    assert "already returns example inputs" in message


def test_module_instance_with_and_without_inputs():
    embedded = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    source = resolve_model(embedded)
    assert source.build(seq_len=7) is embedded
    assert source.example_inputs(2, 7, META)[0].shape == (2, 7)
    assert "cannot infer example inputs" in _resolve_error(torch.nn.Linear(2, 2))
    assert "got int" in _resolve_error(3)
