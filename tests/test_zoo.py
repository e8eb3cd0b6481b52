"""Zoo models: published sizes, meta build speed, spec round trips, MoE routing, validation."""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import pytest
import torch
import torch.fx
import yaml
from hypothesis import given, settings, strategies as st
from torch.utils.flop_counter import FlopCounterMode

from planner.errors import PlannerError, PlannerErrorKind
from planner.graph import Recompute
from planner.measure import measure_piece
from planner.zoo import SPECS_DIR, build_model, example_inputs, zoo_specs
from planner.zoo.moe import MoEFeedForward
from planner.zoo.spec import Arch, ModelSpec, load_spec, parse_spec, parse_spec_text

BF16_BYTES = 2

@functools.cache
def _param_counts(name: str) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) of a zoo model, built once per test session."""
    model = _meta_model(name)
    return _params(model), _expert_params(model)


def _meta_model(name: str, seq_len: int | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(zoo_specs()[name], seq_len)


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _expert_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if "experts" in name.split("."))


def _active_params(name: str) -> float:
    """Parameters one token uses: everything except the unchosen share of routed experts."""
    spec = zoo_specs()[name]
    total, expert = _param_counts(name)
    return total - expert * (1 - spec.top_k / spec.experts)


# (model, published total parameters, relative tolerance, source). Published figures are rounded
# by their authors; tolerances above 1% are for figures given to two significant digits.
PUBLISHED_TOTALS = [
    ("gpt2", 124_439_808, 0.0, "Hugging Face gpt2 (GPT2LMHeadModel) parameter count"),
    ("gpt2-xl", 1_557_611_200, 0.0, "Hugging Face gpt2-xl parameter count"),
    ("gpt3-125m", 125e6, 0.025, "Brown et al. 2020, Table 2.1"),
    ("gpt3-350m", 350e6, 0.025, "Brown et al. 2020, Table 2.1"),
    ("gpt3-760m", 760e6, 0.025, "Brown et al. 2020, Table 2.1"),
    ("gpt3-1.3b", 1.3e9, 0.025, "Brown et al. 2020, Table 2.1"),
    ("gpt3-2.7b", 2.7e9, 0.025, "Brown et al. 2020, Table 2.1"),
    ("gpt3-6.7b", 6.7e9, 0.025, "Brown et al. 2020, Table 2.1"),
    ("gpt3-13b", 13.0e9, 0.025, "Brown et al. 2020, Table 2.1"),
    ("gpt3-175b", 175.0e9, 0.01, "Brown et al. 2020, Table 2.1"),
    ("llama2-7b", 6_738_415_616, 0.0, "Hugging Face meta-llama/Llama-2-7b-hf parameter count"),
    ("llama2-13b", 13.0e9, 0.01, "Touvron et al. 2023, Table 1"),
    ("llama2-70b", 68.98e9, 0.001, "Hugging Face meta-llama/Llama-2-70b-hf: 68,976,648,192"),
    ("llama3-8b", 8.03e9, 0.01, "Meta Llama 3 8B model card (Hugging Face): 8.03B"),
    ("llama3-70b", 70.6e9, 0.01, "Meta Llama 3 70B model card (Hugging Face): 70.6B"),
    ("llama3-405b", 405.9e9, 0.01, "Meta Llama 3.1 405B model card (Hugging Face): 405.9B"),
    ("mixtral-8x7b", 46.7e9, 0.01, "Jiang et al. 2024, Sec. 2: 47B (Mistral AI: 46.7B total)"),
    ("mixtral-8x22b", 141e9, 0.01, "Mistral AI Mixtral 8x22B release: 141B total"),
    ("deepseek-moe-16b", 16.4e9, 0.01, "Dai et al. 2024, Sec. 5.1: 16.4B total"),
    ("qwen3-30b-a3b", 30.5e9, 0.01, "Qwen3-30B-A3B: 30.5B total (vLLM-Ascend Qwen3-30B-A3B tutorial, after the model card)"),
    ("qwen3-235b-a22b", 235e9, 0.01, "NVIDIA NeMo AutoModel docs, Qwen3 MoE: Qwen3-235B-A22B 235B total"),
    ("bert-large", 340e6, 0.02, "Devlin et al. 2019, Sec. 3: 340M (no pooler/NSP head here)"),
    ("vit-l-16", 307e6, 0.01, "Dosovitskiy et al. 2021, Table 1: ViT-Large 307M"),
    ("vit-h-14", 632e6, 0.01, "Dosovitskiy et al. 2021, Table 1: ViT-Huge 632M"),
]

# (model, published active parameters per token, relative tolerance, source).
PUBLISHED_ACTIVE = [
    ("mixtral-8x7b", 12.9e9, 0.01, "Mistral AI: 12.9B active (Jiang et al. 2024: 13B)"),
    ("mixtral-8x22b", 39e9, 0.01, "Mistral AI Mixtral 8x22B release: 39B active"),
    ("deepseek-moe-16b", 2.8e9, 0.02, "Dai et al. 2024, Sec. 5.1: 2.8B activated (rounded)"),
    ("qwen3-30b-a3b", 3.3e9, 0.02, "Qwen3-30B-A3B: 3.3B activated (vLLM-Ascend Qwen3-30B-A3B tutorial, after the model card)"),
    ("qwen3-235b-a22b", 22e9, 0.02, "NVIDIA NeMo AutoModel docs, Qwen3 MoE: Qwen3-235B-A22B 22B activated per token"),
]


@pytest.mark.parametrize("name,published,rel,source", PUBLISHED_TOTALS,
                         ids=[row[0] for row in PUBLISHED_TOTALS])
def test_total_params_match_published(name, published, rel, source):
    assert _param_counts(name)[0] == pytest.approx(published, rel=rel), source


@pytest.mark.parametrize("name,published,rel,source", PUBLISHED_ACTIVE,
                         ids=[row[0] for row in PUBLISHED_ACTIVE])
def test_active_params_match_published(name, published, rel, source):
    assert _active_params(name) == pytest.approx(published, rel=rel), source


def test_head_dim_sets_the_attention_projections_apart_from_hidden():
    # 60 / 8 is not whole, but 8 heads of width 16 are: q and o are 60 x 128, k and v 60 x 32.
    spec = parse_spec({"arch": "llama", "layers": 1, "hidden": 60, "heads": 8, "kv_heads": 2, "head_dim": 16,
                       "ffn_hidden": 64, "vocab": 10}, "wide-heads.yaml")
    attention = build_model(spec).layers[0].attn
    assert [tuple(p.weight.shape) for p in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)] == [
        (128, 60), (32, 60), (32, 60), (60, 128)]


def test_llama2_7b_params_match_closed_form():
    # 32 layers x (4 h^2 attention + 3 h f SwiGLU + 2 h norms) + 2 V h (untied) + h final norm,
    # h = 4096, f = 11008, V = 32000.
    h, f, vocab, layers = 4096, 11008, 32000, 32
    expected = layers * (4 * h * h + 3 * h * f + 2 * h) + 2 * vocab * h + h
    assert _params(_meta_model("llama2-7b")) == expected


def test_every_zoo_model_builds_on_meta():
    # Build time is measured by benchmarks/trace_speed.py, not asserted here.
    for name in zoo_specs():
        model = _meta_model(name)
        assert all(p.device.type == "meta" for p in model.parameters())


def test_build_respects_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = _meta_model("mixtral-8x7b")
    finally:
        torch.set_default_dtype(previous)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("path", sorted(SPECS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_spec_file_round_trips_to_registered_model(path, tmp_path):
    spec = load_spec(path)
    assert zoo_specs()[path.stem] == spec
    copy = tmp_path / f"{path.stem}.json"
    copy.write_text(json.dumps(spec.to_dict()))
    reparsed = load_spec(copy)
    assert reparsed == spec
    with torch.device("meta"):
        assert _params(build_model(reparsed)) == _param_counts(path.stem)[0]


def test_spec_keys_cover_every_model_spec_field():
    written = set().union(*(spec.to_dict() for spec in zoo_specs().values()))
    assert {arch for arch in Arch} == {spec.arch for spec in zoo_specs().values()}
    assert written == {f.name for f in dataclasses.fields(ModelSpec)} - {"name"}


def test_registry_has_every_spec_file_and_required_names():
    assert set(zoo_specs()) == {p.stem for p in SPECS_DIR.glob("*.yaml")}
    required = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-125m", "gpt3-350m",
                "gpt3-760m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b",
                "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b",
                "mixtral-8x7b", "mixtral-8x22b", "deepseek-moe-16b", "bert-large", "vit-l-16",
                "vit-h-14"}
    assert required <= set(zoo_specs())


@pytest.mark.parametrize("name", ["gpt2", "llama3-8b", "mixtral-8x7b", "bert-large", "vit-l-16"])
def test_module_layout_for_pipeline_and_tensor_parallelism(name):
    model = _meta_model(name)
    children = [child for child, _ in model.named_children()]
    assert children[:2] == ["embed", "layers"] and children[-2:] == ["head", "loss"]
    assert isinstance(model.layers, torch.nn.ModuleList)
    assert len(model.layers) == zoo_specs()[name].layers
    block_children = {child for child, _ in model.layers[-1].attn.named_children()}
    assert block_children == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_learned_position_table_grows_with_seq_len():
    assert _meta_model("gpt2").embed.pos.num_embeddings == 1024  # published context
    assert _meta_model("gpt2", seq_len=4096).embed.pos.num_embeddings == 4096
    assert _meta_model("bert-large", seq_len=128).embed.pos.num_embeddings == 512


def test_tied_embeddings_share_one_tensor():
    gpt = _meta_model("gpt3-175b")
    assert gpt.head.weight is gpt.embed.tok.weight
    llama = _meta_model("llama3-8b")
    assert llama.head.weight is not llama.embed.weight


TINY_SPECS = {
    "gpt": {"arch": "gpt", "layers": 2, "hidden": 32, "heads": 4, "vocab": 50, "max_seq_len": 8},
    "llama": {"arch": "llama", "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2,
              "ffn_hidden": 48, "vocab": 50},
    "moe": {"arch": "moe", "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 48,
            "vocab": 50, "experts": 4, "top_k": 2, "moe_ffn_hidden": 16, "shared_experts": 1,
            "dense_layers": 1},
    "bert": {"arch": "bert", "layers": 2, "hidden": 32, "heads": 4, "vocab": 50},
    "vit": {"arch": "vit", "layers": 2, "hidden": 32, "heads": 4, "image_size": 16,
            "patch_size": 8, "classes": 10},
}


@pytest.mark.parametrize("arch", sorted(TINY_SPECS))
def test_tiny_models_fx_trace_and_return_scalar_loss(arch):
    spec = parse_spec(TINY_SPECS[arch], f"{arch}.yaml")
    with torch.device("meta"):
        model = build_model(spec, seq_len=16)
    graph_module = torch.fx.symbolic_trace(model)
    inputs = example_inputs(spec, 2, 16, "meta")
    assert graph_module(*inputs).shape == ()
    torch.manual_seed(0)
    loss = build_model(spec, seq_len=16)(*example_inputs(spec, 2, 16, "cpu"))
    loss.backward()
    assert loss.shape == () and torch.isfinite(loss)


def test_moe_flops_are_tokens_times_top_k_expert_mlps():
    hidden, experts, top_k, ffn, tokens = 32, 8, 2, 16, 64
    with torch.device("meta"):
        layer = MoEFeedForward(hidden, experts, top_k, ffn)
        x = torch.randn(2, tokens // 2, hidden)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    # Router: 2*T*h*E. Experts: three h x f matmuls per token-expert pair, 2 FLOPs per MAC,
    # T*k pairs in total (capacity T*k/E = 16 slots for each of 8 experts).
    expected = 2 * tokens * hidden * experts + 3 * 2 * tokens * top_k * hidden * ffn
    assert counter.get_total_flops() == expected


def test_moe_with_every_expert_chosen_equals_weighted_dense_mixture():
    torch.manual_seed(0)
    hidden, experts, ffn = 8, 3, 4
    layer = MoEFeedForward(hidden, experts, experts, ffn, shared_experts=1)
    x = torch.randn(2, 5, hidden)
    probs = layer.router(x).softmax(-1)
    w = layer.experts
    mixture = sum(
        probs[..., e:e + 1] * ((torch.nn.functional.silu(x @ w.gate_proj.weight[e]) * (x @ w.up_proj.weight[e]))
                               @ w.down_proj.weight[e])
        for e in range(experts))
    torch.testing.assert_close(layer(x), mixture + layer.shared(x))


def test_moe_drops_token_choices_past_expert_capacity():
    hidden, experts = 4, 2
    layer = MoEFeedForward(hidden, experts, top_k=1, ffn_hidden=4)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0] * hidden, [0.0] * hidden]))
    x = torch.ones(1, 4, hidden)  # every token prefers expert 0; capacity = 4*1/2 = 2
    out = layer(x)
    assert torch.count_nonzero(out[0, :2].abs().sum(-1)) == 2
    assert torch.count_nonzero(out[0, 2:]) == 0


def test_moe_keeps_one_copy_of_the_routed_tokens_each_way():
    """Bytes the MoE feed-forward keeps for backward in bf16, T tokens, hidden H, E experts of
    width F, top-k, capacity C = T*k/E, as fused permute kernels keep them: the slots the experts
    read (E*C*H), the gate and up projections, their SiLU and product (4*E*C*F), and the gathered
    expert outputs the routing weights multiply (T*k*H), plus the layer input (T*H), the router's
    probabilities (T*E) and per-pair indices and weights (under 32 bytes a pair). No copy of the
    tokens per pair (T*k*H more) is kept to send them to the slots."""
    hidden, experts, top_k, ffn, tokens = 64, 8, 2, 32, 128
    capacity = tokens * top_k // experts
    with torch.device("meta"):
        layer = MoEFeedForward(hidden, experts, top_k, ffn).to(torch.bfloat16)
        x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16)
    saved = measure_piece(layer, (x,)).saved_bytes[Recompute.NONE]
    routed = BF16_BYTES * (experts * capacity * hidden + 4 * experts * capacity * ffn + tokens * top_k * hidden)
    inputs = BF16_BYTES * (tokens * hidden + tokens * experts)
    assert routed + inputs <= saved < routed + inputs + 32 * tokens * top_k


# Bad specs: (mapping, field named in the error).
BAD_SPECS = [
    ({"arch": "llama", "layers": 2, "hiden": 64, "heads": 4, "ffn_hidden": 8, "vocab": 9}, "hiden"),
    ({"arch": "gpt", "layers": 2, "heads": 4, "vocab": 9}, "hidden"),
    ({"arch": "gpt", "layers": "two", "hidden": 64, "heads": 4, "vocab": 9}, "layers"),
    ({"arch": "gpt", "layers": True, "hidden": 64, "heads": 4, "vocab": 9}, "layers"),
    ({"arch": "gpt", "layers": 0, "hidden": 64, "heads": 4, "vocab": 9}, "layers"),
    ({"arch": "gpt", "layers": 2, "hidden": 64, "heads": 5, "vocab": 9}, "heads"),
    ({"arch": "gpt", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 3, "vocab": 9}, "kv_heads"),
    ({"arch": "gpt", "layers": 2, "hidden": 64, "heads": 4, "vocab": 9, "tie_embeddings": "yes"},
     "tie_embeddings"),
    ({"arch": "gpt", "layers": 2, "hidden": 64, "heads": 4, "vocab": 9, "experts": 4}, "experts"),
    ({"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "vocab": 9}, "ffn_hidden"),
    ({"arch": "llama", "layers": 2, "hidden": 60, "heads": 4, "ffn_hidden": 8, "vocab": 9},
     "heads"),
    ({"arch": "moe", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 8, "vocab": 9,
      "experts": 4, "top_k": 5}, "top_k"),
    ({"arch": "moe", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 8, "vocab": 9,
      "experts": 4, "top_k": 2, "dense_layers": 2}, "dense_layers"),
    ({"arch": "moe", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 8, "vocab": 9,
      "experts": 4, "top_k": 2, "shared_experts": -1}, "shared_experts"),
    ({"arch": "moe", "layers": 2, "hidden": 64, "heads": 4, "vocab": 9, "experts": 4, "top_k": 2}, "moe_ffn_hidden"),
    ({"arch": "moe", "layers": 2, "hidden": 64, "heads": 4, "vocab": 9, "experts": 4, "top_k": 2, "moe_ffn_hidden": 8,
      "dense_layers": 1}, "ffn_hidden"),
    ({"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 8, "vocab": 9,
      "rope_theta": float("nan")}, "rope_theta"),
    ({"arch": "vit", "layers": 2, "hidden": 64, "heads": 4, "image_size": 30, "patch_size": 8},
     "patch_size"),
    ({"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "head_dim": 15, "ffn_hidden": 8, "vocab": 9},
     "head_dim"),
    ({"arch": "gpt", "layers": 2, "hidden": 64, "heads": 4, "head_dim": 32, "vocab": 9}, "head_dim"),
    ({"arch": "lama", "layers": 2}, "arch"),
    ({"layers": 2}, "arch"),
    ({"arch": "gpt", "layers": 20000, "hidden": 64, "heads": 4, "vocab": 9}, "layers"),
]


def test_moe_spec_needs_one_mlp_width_without_dense_layers():
    # Without dense layers the dense width is unused: the expert width alone is enough (and fills it).
    spec = parse_spec({"arch": "moe", "layers": 2, "hidden": 64, "heads": 4, "vocab": 9, "experts": 4, "top_k": 2,
                       "moe_ffn_hidden": 8}, "experts-only.yaml")
    assert (spec.moe_ffn_hidden, spec.ffn_hidden) == (8, 8)


@pytest.mark.parametrize("data,field", BAD_SPECS, ids=[f"{i}-{f}" for i, (_, f) in
                                                       enumerate(BAD_SPECS)])
def test_bad_spec_names_field_and_fix_in_one_line(data, field):
    with pytest.raises(PlannerError) as caught:
        parse_spec(data, "bad.yaml")
    error = caught.value
    assert error.kind == PlannerErrorKind.INVALID_INPUT
    assert error.message.startswith(f"bad.yaml: field `{field}`:")
    assert "; fix: " in error.message and "\n" not in error.message


def test_unknown_key_suggests_nearest_valid_key():
    with pytest.raises(PlannerError, match=r"did you mean `hidden`\?"):
        parse_spec(BAD_SPECS[0][0], "bad.yaml")
    with pytest.raises(PlannerError, match=r"did you mean `llama`\?"):
        parse_spec({"arch": "lama"}, "bad.yaml")


def test_an_unknown_key_far_from_every_spec_key_lists_them():
    with pytest.raises(PlannerError, match=r"field `foo`: unknown key; fix: use one of the documented keys \(arch, layers, hidden,"):
        parse_spec({"arch": "gpt", "layers": 2, "foo": 3}, "bad.yaml")


@pytest.mark.parametrize("profile, what", [("clusters/dgx-h100-su.yaml", "a cluster file (it has `groups`)"),
                                           ("devices/h100-sxm.yaml", "a device profile (it has `peak_flops_per_s`)"),
                                           ("links/ib-ndr400.yaml", "a link profile (it has `bw_bytes_per_s`)")])
def test_a_hardware_profile_given_as_a_model_is_called_what_it_is(profile, what):
    path = Path(__file__).resolve().parents[1] / "profiles" / profile
    with pytest.raises(PlannerError, match=rf"^{re.escape(str(path))}: {re.escape(what)}, not a model spec; fix: pass it as "):
        load_spec(path)


def test_spec_text_errors_are_one_line():
    for text in ["arch: [gpt", "- 1\n- 2", "just a string"]:
        with pytest.raises(PlannerError) as caught:
            parse_spec_text(text, "bad.yaml")
        assert caught.value.kind == PlannerErrorKind.INVALID_INPUT
        assert "\n" not in caught.value.message


@pytest.mark.parametrize("text, origin, message", [
    ("arch: gpt\nlayers: 2\nlayers: 4\n", "twice.yaml", "key 'layers' given twice"),
    ('{"arch": "gpt", "layers": 2, "layers": 4}', "twice.json", "key 'layers' given twice"),
    ('{"arch": "gpt", "layers": 2,}', "trailing.JSON", "not valid JSON"),
])
def test_a_key_given_twice_or_invalid_json_is_refused(text, origin, message):
    # YAML and JSON parsers keep the last of two equal keys silently; JSON is read as JSON, not as
    # the YAML that forgives a trailing comma.
    with pytest.raises(PlannerError, match=message) as caught:
        parse_spec_text(text, origin)
    assert "\n" not in caught.value.message


@pytest.mark.parametrize("text, origin", [
    ('{"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 9, "rope_theta": 1e6}', "sci.json"),
    ("arch: llama\nlayers: 2\nhidden: 64\nheads: 4\nffn_hidden: 128\nvocab: 9\nrope_theta: 1e6\n", "sci.yaml"),
])
def test_a_float_in_exponent_form_is_a_number(text, origin):
    # Hugging Face configs write rope_theta as 1e6, which YAML 1.1 reads as a string.
    assert parse_spec_text(text, origin).rope_theta == 1e6


def test_missing_spec_file_is_invalid_input(tmp_path):
    with pytest.raises(PlannerError, match="not found") as caught:
        load_spec(tmp_path / "absent.yaml")
    assert caught.value.kind == PlannerErrorKind.INVALID_INPUT


def test_defaults_follow_the_documented_rules():
    gpt = parse_spec({"arch": "gpt", "layers": 2, "hidden": 64, "heads": 4, "vocab": 9}, "g.yaml")
    assert (gpt.name, gpt.kv_heads, gpt.ffn_hidden, gpt.tie_embeddings, gpt.max_seq_len) == (
        "g", 4, 256, True, 2048)
    moe = parse_spec({"arch": "moe", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 96,
                      "vocab": 9, "experts": 4, "top_k": 1}, "m.yaml")
    assert (moe.moe_ffn_hidden, moe.shared_experts, moe.dense_layers, moe.tie_embeddings) == (
        96, 0, 0, False)
    assert moe.dims.ffn_hidden == 96 and moe.dims.experts == 4


_KEY_NAMES = [f.name for f in dataclasses.fields(ModelSpec) if f.name != "name"]
_SCALARS = (st.integers(-3, 300) | st.booleans() | st.floats(allow_nan=True) | st.text(max_size=8)
            | st.none() | st.sampled_from(list(Arch)).map(str))
_VALUES = _SCALARS | st.lists(_SCALARS, max_size=3) | st.dictionaries(st.text(max_size=4),
                                                                      _SCALARS, max_size=2)
_KEYS = st.sampled_from(_KEY_NAMES) | st.text(max_size=10) | st.integers()


def _assert_spec_or_planner_error(parse, *args) -> None:
    try:
        result = parse(*args)
    except PlannerError as error:
        assert error.kind == PlannerErrorKind.INVALID_INPUT and "\n" not in error.message
    else:
        assert isinstance(result, ModelSpec)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=12) | _VALUES)
def test_parse_spec_returns_spec_or_planner_error(data):
    _assert_spec_or_planner_error(parse_spec, data, "random.yaml")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120)
       | st.dictionaries(st.sampled_from(_KEY_NAMES), _SCALARS, max_size=12).map(
           lambda d: yaml.safe_dump(d, allow_unicode=True)))
def test_parse_spec_text_returns_spec_or_planner_error(text):
    _assert_spec_or_planner_error(parse_spec_text, text, "random.yaml")
