"""Turns a model into a measured ModelGraph: the `trace` entry point and its capture fallbacks.

Capture, in order of preference (`ModelGraph.trace_method`; why an earlier one failed goes to
`ModelGraph.notes`):

1. "fx": `torch.fx` symbolic tracing of the model built on `meta`, leaf modules (Linear,
   Embedding, norms, convolutions, ...) kept as `call_module`.
2. "export": `torch.export.export(strict=False)` of the same meta model (shape-dependent Python
   control flow is specialised away).
3. "module": an eager run with hooks, one op per leaf-module call. Only an eager run can follow
   control flow on tensor values, so this path builds the model with real weights on the CPU
   and is limited to `EAGER_FALLBACK_MAX_PARAM_BYTES`.

The captured ops are grouped into layers (pipeline-cut units) by `planner.layering` and measured
layer by layer: `planner.graph_layers` on the fx/export paths, `planner.module_layers` on the
module-level path.

Example::

    >>> graph = trace("gpt3-125m", seq_len=1024)
    >>> graph.trace_method, len(graph.blocks)
    ('fx', 12)
"""
from __future__ import annotations

import copy
import functools
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from planner import eager_run, measure
from planner.capture_context import autocast_meta_as_cpu, quiet_export
from planner.errors import PlannerError, PlannerErrorKind, check_positive_int, invalid
from planner.graph import EXPERTS_MODULE, Layer, LayerKind, ModelDims, ModelGraph, OpKind, recurrent_targets
from planner.head_attrs import KEY_VALUE_HEAD_ATTRS, QUERY_HEAD_ATTRS, REPEAT_ATTRS, head_count
from planner.graph_layers import graph_layers
from planner.layering import Grouping, tied_modules
from planner.lm_loss import with_language_model_loss
from planner.models import NO_SEQUENCE_SEQ_LEN, resolve_model
from planner.module_layers import module_layers
from planner.source import ModelSource
from planner.zoo.spec import ModelSpec

# Training dtype -> dtype the model is built and measured in. FP8 recipes (Transformer Engine,
# torchao float8) cast to fp8 only inside the matmuls and keep weights and the activations
# between ops in bf16, so fp8 is measured as bf16.
MEASURE_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.bfloat16,
}
# Traced graphs kept in memory; a sweep or search reuses a few models at a few sequence lengths.
TRACE_CACHE_SIZE = 64
# The module-level fallback runs real bf16 weights on the CPU (plus their gradients and the
# activations), which must stay inside the 2 GB resident-memory budget of `paraplan inspect`.
EAGER_FALLBACK_MAX_PARAM_BYTES = 256 * 2**20
# Error messages quoted in notes are cut to this many characters.
NOTE_REASON_CHARS = 160

_META = torch.device("meta")
_CPU = torch.device("cpu")
_TOKEN_ACTIVATION_RANK = 3  # (batch, sequence, hidden)


def trace(source: ModelSource | str | nn.Module | ModelSpec | tuple, *, seq_len: int | None = None,
          micro_batch: int = 1, dtype: str = "bf16") -> ModelGraph:
    """Traces and measures a model for one micro-batch; results are cached.

    Args:
        source: a ModelSource, or anything `planner.models.resolve_model` accepts (built-in
            name, spec file, "package.module:factory", ModelSpec, nn.Module starting with an
            embedding, or a pair (nn.Module, example_inputs)).
        seq_len: tokens per sequence; the source's default when None.
        micro_batch: sequences per forward (inputs the model fixes keep their own batch).
        dtype: training dtype, one of MEASURE_DTYPES.

    Returns:
        The ModelGraph.

    Raises:
        PlannerError: INVALID_INPUT for bad arguments; UNSUPPORTED_MODEL when no capture method
            works, naming the module where tracing failed.
    """
    if dtype not in MEASURE_DTYPES:
        raise invalid(f"dtype={dtype!r}: unknown; fix: use one of {', '.join(MEASURE_DTYPES)}")
    for field, value in (("seq_len", seq_len), ("micro_batch", micro_batch)):
        if value is not None:
            check_positive_int(field, value)
    resolved = _resolve(source)
    if isinstance(source, tuple):
        source = resolved
    if resolved.fixed_by and seq_len not in (None, resolved.default_seq_len):
        if resolved.default_seq_len == NO_SEQUENCE_SEQ_LEN:
            raise invalid(f"seq_len={seq_len}: model `{resolved.name}` has fixed inputs without a token sequence "
                          f"({resolved.fixed_by}), so each sample counts as one token; leave --seq-len out")
        raise invalid(f"seq_len={seq_len}: model `{resolved.name}` has a fixed sequence length of {resolved.default_seq_len} "
                      f"tokens ({resolved.fixed_by}); leave --seq-len out or give {resolved.default_seq_len}")
    return _trace_cached(source, seq_len or resolved.default_seq_len, resolved.fixed_micro_batch or micro_batch, dtype)


def _resolve(source: ModelSource | str | nn.Module | ModelSpec | tuple) -> ModelSource:
    return source if isinstance(source, ModelSource) else resolve_model(source)


@functools.lru_cache(maxsize=TRACE_CACHE_SIZE)
def _trace_cached(key: ModelSource | str | nn.Module | ModelSpec, seq_len: int, micro_batch: int,
                  dtype: str) -> ModelGraph:
    source = _resolve(key)
    with _default_dtype(MEASURE_DTYPES[dtype]):
        with _META:
            model = source.build(seq_len=seq_len)
        inputs = _example_inputs(source, micro_batch, seq_len, _META)
        notes = (["dtype fp8: traced in bf16, as fp8 recipes (torchao Float8Linear, Transformer Engine) keep weights and "
                  "activations in bf16; the linear layers' GEMMs are priced at the fp8 peak, the rest in bf16"]
                 if dtype == "fp8" else [])
        if seq_len > source.learned_positions > 0:
            notes.append(f"{source.name}'s learned position table of {source.learned_positions} positions is extended to "
                         f"{seq_len} (its weights included): no longer the published model")
        with autocast_meta_as_cpu():
            model = with_language_model_loss(_on_meta(model, notes), inputs, notes)
            grouping = Grouping.of(model)
            method, layers = _capture_and_measure(source, model, inputs, grouping, seq_len,
                                                  micro_batch, notes)
    _check_position_tables(source, layers, seq_len)
    frozen = sum(layer.frozen_params for layer in layers)
    if frozen:
        notes.append(f"{frozen:,} of {sum(layer.params for layer in layers):,} parameters take no gradient (frozen):"
                     " priced without their gradients, optimizer moments, reduction and update, and without the"
                     " backward work and saved activations autograd then skips")
    if recurrent := recurrent_targets(layers):
        notes.append(f"recurrent layers ({', '.join(recurrent)}) are priced as GEMMs over the whole sequence at once: "
                     f"their time steps, which run in sequence order, are not modelled, so their time is optimistic")
    notes += _sequence_first_notes(model)
    dims = source.dims if source.dims != ModelDims() else _infer_dims(model, layers)
    return ModelGraph(name=source.name, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                      trace_method=method, layers=tuple(layers), dims=dims, notes=tuple(notes),
                      tied=tied_modules(model))


def _sequence_first_notes(model: nn.Module) -> list[str]:
    """A note naming the outermost module built sequence-first (`batch_first=False`: nn.Transformer,
    its layers, nn.MultiheadAttention, recurrent layers), which reads dimension 0 as the tokens:
    the trace gives dimension 0 the samples, so such a model is priced with the two swapped."""
    first = next((fqn for fqn, module in model.named_modules() if getattr(module, "batch_first", True) is False), None)
    if first is None:
        return []
    return [f"`{first or type(model).__name__}` is built sequence-first (batch_first=False) and reads dimension 0 as the "
            f"tokens, while the inputs are laid out batch first: priced with the sequence and the batch swapped (its "
            f"attention over micro-batch-long sequences); fix: build it with batch_first=True"]


# Ops that pass their input's values on unchanged (position ids reshaped or broadcast on their way to a table).
_VALUE_PRESERVING_TARGETS = frozenset({"unsqueeze", "expand", "view", "reshape", "to", "long", "int", "repeat", "contiguous"})


def _check_position_tables(source: ModelSource, layers: Sequence[Layer], seq_len: int) -> None:
    """Raises INVALID_INPUT where an embedding is looked up at positions 0 .. seq_len - 1 (an
    `arange`, maybe reshaped) and holds fewer rows: on a device the lookup fails, on the meta
    tensors tracing uses it does not."""
    ops = {op.name: op for layer in layers for op in layer.ops}
    for op in ops.values():
        if op.kind != OpKind.EMBEDDING or not op.param_shapes or not op.inputs:
            continue
        source_op = ops.get(op.inputs[0])
        while source_op is not None and source_op.target in _VALUE_PRESERVING_TARGETS and source_op.inputs:
            source_op = ops.get(source_op.inputs[0])
        rows = op.param_shapes[0][0]
        if source_op is not None and source_op.target == "arange" and source_op.out_shape and source_op.out_shape[0] > rows:
            raise invalid(f"seq_len={seq_len}: `{op.fqn}` of model `{source.name}` is a learned position table of {rows} "
                          f"positions, looked up at {source_op.out_shape[0]}; fix: --seq-len of at most {rows}")


def _example_inputs(source: ModelSource, micro_batch: int, seq_len: int,
                    device: torch.device) -> tuple:
    """The source's inputs on `device`, floating ones in the training dtype (the default dtype
    while tracing), as a mixed-precision step feeds them."""
    inputs = tuple(source.example_inputs(micro_batch, seq_len, device))
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(torch.get_default_dtype()) if t.is_floating_point() else t,
        inputs)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _on_meta(model: nn.Module, notes: list[str]) -> nn.Module:
    """The model itself if all its tensors are on meta; else (a module passed in with real
    weights) a copy whose parameters and buffers are meta tensors of the same shapes, floating
    ones in the training dtype (the default dtype while tracing)."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device == _META for t in tensors):
        return model
    memo = {id(t): _meta_like(t) for t in tensors}
    notes.append("model given with real weights: traced on a meta copy")
    return copy.deepcopy(model, memo)


def _in_dtypes_of(model: nn.Module, reference: nn.Module) -> nn.Module:
    """`model`, or, where its dtypes differ from `reference`'s (the meta model, in the training
    dtype), a copy whose parameters and buffers take the dtypes of `reference`'s of the same name:
    the module-level run then measures what the fx and export paths measure."""
    wanted = {name: t.dtype for name, t in [*reference.named_parameters(), *reference.named_buffers()]}
    named = [*model.named_parameters(), *model.named_buffers()]
    if all(wanted.get(name, t.dtype) == t.dtype for name, t in named):
        return model
    memo = {id(t): _retyped(t, wanted.get(name, t.dtype)) for name, t in named}
    return copy.deepcopy(model, memo)


def _retyped(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    cast = t.detach().to(dtype)
    return nn.Parameter(cast, t.requires_grad) if isinstance(t, nn.Parameter) else cast


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    dtype = torch.get_default_dtype() if t.is_floating_point() else t.dtype
    meta = torch.empty_like(t, device=_META, dtype=dtype)
    return nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta


class _BlockTracer(fx.Tracer):
    """fx's tracer, except that the block stack, its ancestors and the blocks are traced through
    even when torch.nn defines them (fx keeps torch.nn modules whole: an nn.TransformerEncoder
    would be one op, its layers no pipeline cut)."""

    def __init__(self, grouping: Grouping):
        super().__init__()
        self.grouping = grouping
        # A buffer the forward slices or reduces (a mask or position table built for a longer
        # context) must stay a graph input, not a folded constant, to be counted whole.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        container = self.grouping.container
        name = module_qualified_name
        if container and (container == name or container.startswith(f"{name}.") or (
                name.startswith(f"{container}.") and "." not in name[len(container) + 1:])):
            return False
        return super().is_leaf_module(m, module_qualified_name)


def _no_grad_output(source: ModelSource, error: measure.NoGradOutputError) -> PlannerError:
    return PlannerError(PlannerErrorKind.UNSUPPORTED_MODEL, _one_line(
        f"model `{source.name}`: its output ({error}) holds no tensor that requires grad, so no backward "
        f"can be measured; fix: return the logits or the loss as a tensor, or a tuple, dict or dataclass "
        f"of them"))


def _capture_and_measure(source: ModelSource, model: nn.Module, inputs: tuple,
                         grouping: Grouping, seq_len: int, micro_batch: int,
                         notes: list[str]) -> tuple[str, list[Layer]]:
    """Tries fx, then export, then the eager module-level run; appends failure reasons."""
    tracer = _BlockTracer(grouping)
    try:
        graph = tracer.trace(model)
        return "fx", graph_layers(model, graph, model, inputs, grouping, notes)
    except measure.NoGradOutputError as exc:
        raise _no_grad_output(source, exc) from None
    except measure.ModuleRunError as exc:
        notes.append(f"fx graph failed to run in {_module_label(exc.fqn)}: "
                     f"{_reason(exc.__cause__)}")
    except Exception as exc:  # noqa: BLE001 - any tracing failure moves on to the next method
        failed_in = next(reversed(tracer.module_stack.values()), ("",))[0]
        notes.append(f"fx failed in {_module_label(failed_in)}: {_reason(exc)}")
    try:
        with quiet_export():
            gm = torch.export.export(model, inputs, strict=False).module()
        return "export", graph_layers(gm, gm.graph, model, inputs, grouping, notes)
    except measure.NoGradOutputError as exc:
        raise _no_grad_output(source, exc) from None
    except measure.ModuleRunError as exc:
        notes.append(f"export graph failed to run in {_module_label(exc.fqn)}: "
                     f"{_reason(exc.__cause__)}")
    except Exception as exc:  # noqa: BLE001
        notes.append(f"export failed: {_reason(exc)}")
    if any("Storage size calculation overflowed" in note for note in notes):  # a tensor past int64 bytes
        raise invalid(f"seq_len={seq_len}: too long for model `{source.name}`, one of whose tensors would then hold more "
                      f"bytes than PyTorch can address; fix: a shorter --seq-len")
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    if param_bytes > EAGER_FALLBACK_MAX_PARAM_BYTES:
        raise PlannerError(PlannerErrorKind.UNSUPPORTED_MODEL, _one_line(
            f"model `{source.name}`: cannot trace ({'; '.join(notes)}); the module-level "
            f"fallback runs real weights and is limited to "
            f"{EAGER_FALLBACK_MAX_PARAM_BYTES >> 20} MiB ({param_bytes >> 20} MiB here); fix: "
            f"make the failing module traceable by torch.fx or torch.export"))
    with _CPU:
        cpu_model = _in_dtypes_of(source.build(seq_len=seq_len), model)
    cpu_inputs = _example_inputs(source, micro_batch, seq_len, _CPU)
    try:
        run = eager_run.run_eager(cpu_model, cpu_inputs)
    except measure.ModuleRunError as exc:
        table = cpu_model.get_submodule(exc.fqn) if exc.fqn else None
        if isinstance(table, nn.Embedding) and isinstance(exc.__cause__, IndexError) and table.num_embeddings < seq_len:
            raise invalid(f"seq_len={seq_len}: `{exc.fqn}` of model `{source.name}` is a table of {table.num_embeddings} "
                          f"rows, looked up out of range at this length (learned positions); fix: --seq-len of at most "
                          f"{table.num_embeddings}") from None
        raise PlannerError(PlannerErrorKind.UNSUPPORTED_MODEL, _one_line(
            f"model `{source.name}`: cannot trace: {'; '.join(notes)}; the module-level run "
            f"failed in {_module_label(exc.fqn)}: {_reason(exc.__cause__)}; fix: it fails in plain eager "
            f"PyTorch too, so check that module's forward and the example inputs' shapes and dtypes")) from None
    except measure.NoGradOutputError as exc:
        raise _no_grad_output(source, exc) from None
    notes.append("module-level trace: one op per leaf-module call, measured in one eager run "
                 "on CPU tensors")
    return "module", module_layers(run, cpu_model, grouping, notes)


def _module_label(fqn: str) -> str:
    return f"module `{fqn}`" if fqn else "the root module"


def _reason(exc: BaseException | None) -> str:
    text = _one_line(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= NOTE_REASON_CHARS else text[:NOTE_REASON_CHARS - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


# Experts held in one module stack their weights: (experts, in_features, out_features).
STACKED_EXPERT_WEIGHT_RANK = 3


def _infer_dims(model: nn.Module, layers: Sequence[Layer]) -> ModelDims:
    """Architecture facts read off the trace when the source does not give them."""
    blocks = [layer for layer in layers if layer.kind == LayerKind.BLOCK]
    ops = [op for layer in (blocks[:1] or layers) for op in layer.ops]
    attention = next((op for op in ops if op.kind == OpKind.ATTENTION), None)
    block_out = blocks[0].ops[-1].out_shape if blocks and blocks[0].ops else ()
    hidden = block_out[-1] if len(block_out) == _TOKEN_ACTIVATION_RANK else 0
    embedding = next((op for layer in layers for op in layer.ops
                      if op.kind == OpKind.EMBEDDING), None)
    ffn = max((op.attrs["out_features"] for op in ops if op.kind == OpKind.MATMUL
               and op.attrs.get("in_features") == hidden), default=0)
    experts, top_k = _expert_counts(model)
    heads, kv_heads = (attention.attrs["heads"], attention.attrs["kv_heads"]) if attention else _attribute_heads(model)
    repeat = next((count for module in model.modules() if (count := head_count(module, REPEAT_ATTRS))), 1)
    if kv_heads == heads and repeat > 1 and heads % repeat == 0:
        kv_heads = heads // repeat  # keys and values repeated to every query head before the attention call
    return ModelDims(
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        layers=len(blocks),
        vocab=embedding.attrs["num_embeddings"] if embedding else 0,
        ffn_hidden=ffn if ffn > hidden else 0,
        experts=experts,
        top_k=top_k,
    )


def _attribute_heads(model: nn.Module) -> tuple[int, int]:
    """(heads, key/value heads) of the first module keeping a head count in an attribute
    (`planner.head_attrs`: nn.MultiheadAttention's `num_heads`, Hugging Face's
    `num_attention_heads`), for attention the trace shows no scaled-dot-product call of; (0, 0)
    when no module keeps one."""
    for module in model.modules():
        if heads := head_count(module, QUERY_HEAD_ATTRS):
            return heads, head_count(module, KEY_VALUE_HEAD_ATTRS) or heads
    return 0, 0


def _expert_counts(model: nn.Module) -> tuple[int, int]:
    """(experts, experts per token) of the first submodule named `experts`: a ModuleList of experts,
    or one module whose weights stack them on dim 0 (the zoo's `GroupedLinear`); the count per
    token from its parent's `top_k` or `num_experts_per_tok` (0 where it states neither)."""
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if leaf != EXPERTS_MODULE:
            continue
        stacked = next((p.shape[0] for p in module.parameters() if p.dim() == STACKED_EXPERT_WEIGHT_RANK), 0)
        experts = len(module) if isinstance(module, nn.ModuleList) else stacked
        owner = model.get_submodule(parent)
        top_k = getattr(owner, "top_k", None) or getattr(owner, "num_experts_per_tok", None) or 0
        return experts, top_k if isinstance(top_k, int) else 0
    return 0, 0
