"""Turns a model into a measured ModelGraph: layers (pipeline-cut units), their ops and costs.

Capture, in order of preference (`ModelGraph.trace_method`; why an earlier one failed goes to
`ModelGraph.notes`):

1. "fx": `torch.fx` symbolic tracing of the model built on `meta`, leaf modules (Linear,
   Embedding, norms, convolutions, ...) kept as `call_module`.
2. "export": `torch.export.export(strict=False)` of the same meta model (shape-dependent Python
   control flow is specialised away).
3. "module": an eager run with hooks, one op per leaf-module call. Only an eager run can follow
   control flow on tensor values, so this path builds the model with real weights on the CPU
   and is limited to `EAGER_FALLBACK_MAX_PARAM_BYTES`.

Layers: the nn.ModuleList / nn.Sequential whose structurally identical children are most
numerous (and hold at least `BLOCK_CONTAINER_MIN_PARAM_SHARE` of the weights) is the block stack.
Ops that run before its first block form the "embed" layer, each block is a layer, and the ops
after the last block (final norm, head, loss) form the "head" layer; functional code between
blocks stays with the block before it, a module between blocks is a layer of its own (kind
OTHER). A model without such a stack gets one layer per top-level child (kind OTHER),
root-level functional code joining the layer that ran before it.

Measurement (`planner.measure`): on the fx/export paths each layer's ops are cut out of the graph
as a standalone GraphModule and measured once per layer signature (ops, module structure,
parameter and input shapes), so a 126-block model measures one block. The module path measures
the whole model in one eager run and attributes by module.

Example::

    >>> graph = trace("gpt3-125m", seq_len=1024)
    >>> graph.trace_method, len(graph.blocks)
    ('fx', 12)
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import io
import logging
import operator
import re
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from planner import measure
from planner.errors import PlannerError, PlannerErrorKind, invalid
from planner.graph import Layer, LayerKind, ModelDims, ModelGraph, Op, OpKind, Recompute
from planner.models import resolve_model
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
# A block stack holds most of a transformer's weights; a minor repeated container (two identical
# conv blocks of a CNN stage, the experts of one MoE layer) is not the pipeline-cut axis.
BLOCK_CONTAINER_MIN_PARAM_SHARE = 0.5
# The module-level fallback runs real bf16 weights on the CPU (plus their gradients and the
# activations), which must stay inside the 2 GB resident-memory budget of `paraplan inspect`.
EAGER_FALLBACK_MAX_PARAM_BYTES = 256 * 2**20
# Error messages quoted in notes are cut to this many characters.
NOTE_REASON_CHARS = 160

_META = torch.device("meta")
_CPU = torch.device("cpu")
_CALL_OPS = ("call_function", "call_method", "call_module")
_EXPERTS_MODULE = "experts"
_EXPORT_LOGGERS = ("torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes")
_LOSS_SUFFIX = "_loss"
_TOKEN_ACTIVATION_RANK = 3  # (batch, sequence, hidden)

_KIND_BY_TARGET = {
    **dict.fromkeys(("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d",
                     "conv2d", "conv3d", "convolution"), OpKind.MATMUL),
    "scaled_dot_product_attention": OpKind.ATTENTION,
    "embedding": OpKind.EMBEDDING,
    **dict.fromkeys(("layer_norm", "rms_norm", "group_norm", "batch_norm", "batch_norm1d",
                     "batch_norm2d", "batch_norm3d"), OpKind.NORM),
    **dict.fromkeys(("cross_entropy", "nll", "nll_loss", "mse", "mse_loss", "l1", "l1_loss",
                     "binary_cross_entropy"), OpKind.LOSS),
    **dict.fromkeys(("add", "sub", "mul", "truediv", "div", "neg", "pow", "exp", "cos", "sin",
                     "rsqrt", "gelu", "silu", "relu", "tanh", "sigmoid", "softmax",
                     "log_softmax", "dropout", "where", "float", "to"), OpKind.ELEMENTWISE),
}


def trace(source: ModelSource | str | nn.Module | ModelSpec, *, seq_len: int | None = None,
          micro_batch: int = 1, dtype: str = "bf16") -> ModelGraph:
    """Traces and measures a model for one micro-batch; results are cached.

    Args:
        source: a ModelSource, or anything `planner.models.resolve_model` accepts (built-in
            name, spec file, "package.module:factory", ModelSpec, nn.Module starting with an
            embedding).
        seq_len: tokens per sequence; the source's default when None.
        micro_batch: sequences per forward.
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
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise invalid(f"{field}={value!r}: must be a positive integer")
    resolved = _resolve(source)
    return _trace_cached(source, seq_len or resolved.default_seq_len, micro_batch, dtype)


def _resolve(source: ModelSource | str | nn.Module | ModelSpec) -> ModelSource:
    return source if isinstance(source, ModelSource) else resolve_model(source)


@functools.lru_cache(maxsize=TRACE_CACHE_SIZE)
def _trace_cached(key: ModelSource | str | nn.Module | ModelSpec, seq_len: int, micro_batch: int,
                  dtype: str) -> ModelGraph:
    source = _resolve(key)
    with _default_dtype(MEASURE_DTYPES[dtype]):
        with _META:
            model = source.build(seq_len=seq_len)
        inputs = _example_inputs(source, micro_batch, seq_len, _META)
        notes = [f"dtype {dtype} measured as {MEASURE_DTYPES[dtype]}"] if dtype == "fp8" else []
        model = _on_meta(model, notes)
        grouping = _Grouping.of(model)
        method, layers = _capture_and_measure(source, model, inputs, grouping, seq_len,
                                              micro_batch, notes)
    dims = source.dims if source.dims != ModelDims() else _infer_dims(model, layers)
    return ModelGraph(name=source.name, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                      trace_method=method, layers=tuple(layers), dims=dims, notes=tuple(notes))


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


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    dtype = torch.get_default_dtype() if t.is_floating_point() else t.dtype
    meta = torch.empty_like(t, device=_META, dtype=dtype)
    return nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _capture_and_measure(source: ModelSource, model: nn.Module, inputs: tuple,
                         grouping: _Grouping, seq_len: int, micro_batch: int,
                         notes: list[str]) -> tuple[str, list[Layer]]:
    """Tries fx, then export, then the eager module-level run; appends failure reasons."""
    tracer = fx.Tracer()
    try:
        graph = tracer.trace(model)
        return "fx", _graph_layers(model, graph, model, inputs, grouping, notes)
    except measure.ModuleRunError as exc:
        notes.append(f"fx graph failed to run in {_module_label(exc.fqn)}: "
                     f"{_reason(exc.__cause__)}")
    except Exception as exc:  # noqa: BLE001 - any tracing failure moves on to the next method
        failed_in = next(reversed(tracer.module_stack.values()), ("",))[0]
        notes.append(f"fx failed in {_module_label(failed_in)}: {_reason(exc)}")
    try:
        with _quiet_export():
            gm = torch.export.export(model, inputs, strict=False).module()
        return "export", _graph_layers(gm, gm.graph, model, inputs, grouping, notes)
    except measure.ModuleRunError as exc:
        notes.append(f"export graph failed to run in {_module_label(exc.fqn)}: "
                     f"{_reason(exc.__cause__)}")
    except Exception as exc:  # noqa: BLE001
        notes.append(f"export failed: {_reason(exc)}")
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    if param_bytes > EAGER_FALLBACK_MAX_PARAM_BYTES:
        raise PlannerError(PlannerErrorKind.UNSUPPORTED_MODEL, _one_line(
            f"model `{source.name}`: cannot trace ({'; '.join(notes)}); the module-level "
            f"fallback runs real weights and is limited to "
            f"{EAGER_FALLBACK_MAX_PARAM_BYTES >> 20} MiB ({param_bytes >> 20} MiB here); fix: "
            f"make the failing module traceable by torch.fx or torch.export"))
    with _CPU:
        cpu_model = source.build(seq_len=seq_len)
    cpu_inputs = _example_inputs(source, micro_batch, seq_len, _CPU)
    try:
        run = measure.run_eager(cpu_model, cpu_inputs)
    except measure.ModuleRunError as exc:
        raise PlannerError(PlannerErrorKind.UNSUPPORTED_MODEL, _one_line(
            f"model `{source.name}`: cannot trace: {'; '.join(notes)}; the module-level run "
            f"failed in {_module_label(exc.fqn)}: {_reason(exc.__cause__)}; fix: make that "
            f"module traceable by torch.fx or torch.export")) from None
    notes.append("module-level trace: one op per leaf-module call, measured in one eager run "
                 "on CPU tensors")
    return "module", _module_layers(run, cpu_model, grouping, notes)


@contextmanager
def _quiet_export() -> Iterator[None]:
    """Silences what a failing torch.export prints: the partial graph (written to stderr) and
    logged guard warnings; the reason is kept in the notes instead."""
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _module_label(fqn: str) -> str:
    return f"module `{fqn}`" if fqn else "the root module"


def _reason(exc: BaseException | None) -> str:
    text = _one_line(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= NOTE_REASON_CHARS else text[:NOTE_REASON_CHARS - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


@dataclasses.dataclass(frozen=True)
class _Grouping:
    """Maps module FQNs to pipeline-cut units.

    Attributes:
        container: FQN of the block stack, or None.
        outer: FQNs of the container's ancestors ("" is the root); without a container, {""}.
    """

    container: str | None
    outer: frozenset[str]

    @classmethod
    def of(cls, model: nn.Module) -> _Grouping:
        container = _find_block_container(model)
        if container is None:
            return cls(None, frozenset({""}))
        parts = container.split(".")
        return cls(container, frozenset(".".join(parts[:i]) for i in range(len(parts))))

    def unit_of(self, fqn: str) -> str | None:
        """The block or top-level unit FQN that `fqn` belongs to; None for code that runs in
        the root or in an ancestor of the block stack."""
        if fqn in self.outer:
            return None
        parent = max((o for o in self.outer if not o or fqn.startswith(o + ".")), key=len)
        rest = fqn[len(parent) + 1:] if parent else fqn
        unit = f"{parent}.{rest.split('.')[0]}" if parent else rest.split(".")[0]
        if unit == self.container:
            return f"{unit}.{fqn[len(unit) + 1:].split('.')[0]}"
        return unit

    def is_block(self, unit: str) -> bool:
        return self.container is not None and unit.startswith(self.container + ".")


def _find_block_container(model: nn.Module) -> str | None:
    """The ModuleList/Sequential with the most structurally identical children among those whose
    children hold BLOCK_CONTAINER_MIN_PARAM_SHARE of the parameters."""
    total = sum(p.numel() for p in model.parameters())
    best, best_count = None, 1
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        signatures = [_module_signature(child) for child in module.children()]
        count = max((signatures.count(s) for s in set(signatures)), default=0)
        share = sum(p.numel() for p in module.parameters()) / total if total else 0.0
        if count > best_count and share >= BLOCK_CONTAINER_MIN_PARAM_SHARE:
            best, best_count = fqn, count
    return best


def _module_signature(module: nn.Module) -> str:
    """Structure of a module: submodule classes and settings, parameter shapes and dtypes."""
    parts = [f"{name}:{type(m).__qualname__}({m.extra_repr()})" for name, m in
             module.named_modules()]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in module.named_parameters()]
    return _digest(parts)


def _digest(parts: Sequence[str]) -> str:
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def _layer_keys(units: Sequence[str | None], grouping: _Grouping) -> list[tuple[LayerKind, str]]:
    """(kind, name) of the layer of each op, given the unit each op runs in, in run order."""
    blocks = [i for i, u in enumerate(units) if u is not None and grouping.is_block(u)]
    keys: list[tuple[LayerKind, str] | None] = []
    current = None
    for i, unit in enumerate(units):
        if blocks and i < blocks[0]:
            current = (LayerKind.EMBEDDING, "embed")
        elif blocks and i > blocks[-1]:
            current = (LayerKind.HEAD, "head")
        elif unit is not None:
            current = (LayerKind.BLOCK if grouping.is_block(unit) else LayerKind.OTHER, unit)
        keys.append(current)
    first = next((k for k in keys if k is not None), (LayerKind.OTHER, ""))
    return [k or first for k in keys]


def _runs(items: Sequence, keys: Sequence[tuple[LayerKind, str]]) -> list[tuple[tuple, list]]:
    """Splits items into runs of consecutive equal keys: the layers, in run order. A key that
    comes back after other layers (a module called twice) starts a new layer `<name>#<n>`."""
    runs: list[tuple[tuple, list]] = []
    repeats: dict[tuple, int] = {}
    for item, key in zip(items, keys):
        if runs and runs[-1][1] == key:
            runs[-1][2].append(item)
            continue
        repeat = repeats.get(key, 0)
        repeats[key] = repeat + 1
        kind, name = key
        runs.append(((kind, f"{name}#{repeat}" if repeat else name), key, [item]))
    return [(named, run) for named, _, run in runs]


# --- fx / export graphs -------------------------------------------------------------------


def _graph_layers(root: nn.Module, graph: fx.Graph, model: nn.Module, inputs: tuple,
                  grouping: _Grouping, notes: list[str]) -> list[Layer]:
    """Layers of a captured graph. Values propagate on meta layer by layer; a layer whose
    signature (which covers its input shapes) was seen before reuses that layer's node values,
    FLOPs and measurement instead of running."""
    interpreter = fx.Interpreter(root, graph=graph)
    values = interpreter.env
    values.update(zip([n for n in graph.nodes if n.op == "placeholder"], inputs))
    values.update({n: _fetch_attr(root, n.target) for n in graph.nodes if n.op == "get_attr"})
    nodes = [n for n in graph.nodes if n.op in _CALL_OPS]
    keys = _layer_keys([grouping.unit_of(_node_fqn(n)) for n in nodes], grouping)
    flops: dict[fx.Node, int] = {}
    first_seen: dict[str, list[fx.Node]] = {}
    costs: dict[str, measure.PieceCost] = {}
    param_names = {id(p): name for name, p in model.named_parameters()}
    owned: set[int] = set()
    layers = []
    for (kind, name), layer_nodes in _runs(nodes, keys):
        signature = _graph_signature(root, kind, layer_nodes, values)
        if signature in first_seen:
            for node, twin in zip(layer_nodes, first_seen[signature]):
                values[node], flops[node] = values[twin], flops[twin]
        else:
            first_seen[signature] = layer_nodes
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                for node in layer_nodes:
                    before = counter.get_total_flops()
                    values[node] = _run_node(interpreter, node)
                    flops[node] = counter.get_total_flops() - before
            piece, piece_inputs = _extract(root, layer_nodes)
            try:
                costs[signature] = measure.measure_piece(
                    piece, tuple(values[n] for n in piece_inputs),
                    data_args=frozenset(i for i, n in enumerate(piece_inputs)
                                        if n.op == "placeholder"))
            except Exception as exc:  # noqa: BLE001 - user code may raise anything
                raise measure.ModuleRunError(name) from exc
        params = _new_params(_node_params(root, layer_nodes), owned)
        ops = tuple(op for n in layer_nodes if (op := _graph_op(root, n, values, flops)))
        layers.append(_layer(name, kind, _units(grouping, layer_nodes), costs[signature],
                             signature, params, param_names, ops))
    notes += _unused_params_notes(model, owned)
    return layers


def _run_node(interpreter: fx.Interpreter, node: fx.Node):
    try:
        return interpreter.run_node(node)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        raise measure.ModuleRunError(_node_fqn(node)) from exc


def _node_fqn(node: fx.Node) -> str:
    """FQN of the module a node runs in ("" for the root)."""
    if node.op == "call_module":
        return node.target
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0] if stack else ""


def _units(grouping: _Grouping, nodes: Sequence[fx.Node]) -> tuple[str, ...]:
    """The block or top-level module FQNs a layer's nodes run in, in run order."""
    return tuple(dict.fromkeys(u for n in nodes
                               if (u := grouping.unit_of(_node_fqn(n))) is not None))


def _extract(root: nn.Module, nodes: Sequence[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """Cuts `nodes` out as a standalone GraphModule (parameters read via get_attr are copied in).

    Returns:
        The module, and the outside nodes whose values it takes as inputs, in order.
    """
    graph = fx.Graph()
    inside = set(nodes)
    copies: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def remap(arg: fx.Node) -> fx.Node:
        if arg not in copies:
            if arg.op == "get_attr":
                copies[arg] = graph.node_copy(arg)
            else:
                copies[arg] = graph.placeholder(arg.name)
                inputs.append(arg)
        return copies[arg]

    for node in nodes:
        copies[node] = graph.node_copy(node, remap)
    graph.output(tuple(copies[n] for n in nodes if any(u not in inside for u in n.users)))
    return fx.GraphModule(root, graph), inputs


def _graph_signature(root: nn.Module, kind: LayerKind, nodes: Sequence[fx.Node],
                     values: dict) -> str:
    """Structural key: op targets, module settings, parameter and input shapes, constants."""
    local = {n: i for i, n in enumerate(nodes)}

    def describe(arg):
        if not isinstance(arg, fx.Node):
            return arg
        if arg in local:
            return f"%{local[arg]}"
        return _shape_of(values[arg])

    parts = [str(kind)]
    for node in nodes:
        target = node.target
        if node.op == "call_module":
            target = _module_signature(root.get_submodule(node.target))
        parts.append(f"{node.op}:{getattr(target, '__qualname__', target)}:"
                     f"{fx.node.map_aggregate((node.args, node.kwargs), describe)}")
    return _digest(parts)


def _shape_of(value) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return pytree.tree_map_only(torch.Tensor, _shape_of, value)


def _fetch_attr(root: nn.Module, target: str):
    return operator.attrgetter(target)(root)


def _node_params(root: nn.Module, nodes: Sequence[fx.Node]) -> list[nn.Parameter]:
    params = []
    for node in nodes:
        if node.op == "call_module":
            params += root.get_submodule(node.target).parameters()
        params += [_fetch_attr(root, a.target) for a in node.all_input_nodes if a.op == "get_attr"]
    return [p for p in params if isinstance(p, nn.Parameter)]


def _new_params(params: Sequence[nn.Parameter], owned: set[int]) -> list[nn.Parameter]:
    """Parameters not owned by an earlier layer (a tied weight counts once, where first used)."""
    fresh = []
    for p in params:
        if id(p) not in owned:
            owned.add(id(p))
            fresh.append(p)
    return fresh


def _graph_op(root: nn.Module, node: fx.Node, values: dict, flops: dict) -> Op | None:
    value = values[node]
    out = _first_tensor(value)
    if out is None:
        return None
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        target = _module_target(module)
        param_shapes = tuple(tuple(p.shape) for p in module.parameters())
    else:
        target = _function_target(node)
        param_shapes = tuple(tuple(p.shape) for a in node.all_input_nodes if a.op == "get_attr"
                             and isinstance(p := _fetch_attr(root, a.target), nn.Parameter))
    kind = _KIND_BY_TARGET.get(target, OpKind.OTHER)
    attrs = _op_attrs(kind, param_shapes, [values[a] for a in node.all_input_nodes
                                           if a.op != "get_attr"])
    return Op(name=node.name, fqn=_node_fqn(node), target=target, kind=kind,
              inputs=tuple(a.name for a in node.all_input_nodes
                           if a.op in _CALL_OPS and _first_tensor(values[a]) is not None),
              out_shape=tuple(out.shape),
              out_bytes=sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
                            if isinstance(t, torch.Tensor)),
              fwd_flops=float(flops[node]), param_shapes=param_shapes, attrs=attrs)


def _first_tensor(value: object) -> torch.Tensor | None:
    return next((t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)), None)


def _function_target(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def _module_target(module: nn.Module) -> str:
    """Functional name of a leaf module: Linear -> linear, CrossEntropyLoss -> cross_entropy."""
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_",
                  type(module).__name__).lower()
    return name.removesuffix(_LOSS_SUFFIX)


def _op_attrs(kind: OpKind, param_shapes: tuple, input_values: list) -> dict:
    if kind == OpKind.MATMUL and param_shapes and len(param_shapes[0]) == 2:
        return {"in_features": param_shapes[0][1], "out_features": param_shapes[0][0]}
    if kind == OpKind.ATTENTION and len(input_values) >= 2:
        query, key = input_values[0], input_values[1]
        return {"heads": query.shape[-3], "kv_heads": key.shape[-3]}
    if kind == OpKind.EMBEDDING and param_shapes:
        return {"num_embeddings": param_shapes[0][0], "embedding_dim": param_shapes[0][1]}
    return {}


def _unused_params_notes(model: nn.Module, owned: set[int]) -> list[str]:
    unused = [name for name, p in model.named_parameters() if id(p) not in owned]
    if not unused:
        return []
    modules = ", ".join(dict.fromkeys(name.rpartition(".")[0] or name for name in unused))
    return [f"{len(unused)} parameter tensors are never used by the traced forward and are in "
            f"no layer: {modules}"]


def _layer(name: str, kind: LayerKind, fqns: tuple[str, ...], cost: measure.PieceCost,
           signature: str, params: Sequence[nn.Parameter], param_names: dict[int, str],
           ops: tuple[Op, ...]) -> Layer:
    return Layer(
        name=name, kind=kind, fqns=fqns,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        expert_params=sum(p.numel() for p in params
                          if _EXPERTS_MODULE in param_names.get(id(p), "").split(".")),
        fwd_flops=cost.fwd_flops, bwd_flops=cost.bwd_flops, saved_bytes=cost.saved_bytes,
        out_bytes=cost.out_bytes, signature=signature, ops=ops)


# --- module-level fallback ------------------------------------------------------------------


def _module_layers(run: measure.EagerRun, model: nn.Module, grouping: _Grouping,
                   notes: list[str]) -> list[Layer]:
    units = [grouping.unit_of(call.fqn) for call in run.calls]
    keys = _layer_keys(units, grouping)
    param_names = {id(p): name for name, p in model.named_parameters()}
    owned: set[int] = set()
    unattributed_fwd, unattributed_bwd = run.module_flops[""]
    layers = []
    for (kind, name), indices in _runs(range(len(run.calls)), keys):
        layer_units = tuple(dict.fromkeys(units[i] for i in indices if units[i] is not None))
        fwd = float(sum(run.module_flops[u][0] for u in layer_units))
        bwd = float(sum(run.module_flops[u][1] for u in layer_units))
        unattributed_fwd, unattributed_bwd = unattributed_fwd - fwd, unattributed_bwd - bwd
        first, last = indices[0], indices[-1]
        # Tensors saved before the first leaf call (index -1) belong to the first layer.
        saved = run.saved_bytes(lambda i: first <= max(i, 0) <= last)
        saved[Recompute.FULL] = run.in_bytes[layer_units[0]] if layer_units else 0
        cost = measure.PieceCost(fwd_flops=fwd, bwd_flops=bwd, saved_bytes=saved,
                                 in_bytes=saved[Recompute.FULL],
                                 out_bytes=run.out_bytes[layer_units[-1]] if layer_units else 0)
        params = _new_params([p for u in layer_units
                              for p in model.get_submodule(u).parameters()], owned)
        signature = _digest([str(kind)] + [_module_signature(model.get_submodule(u))
                                           for u in layer_units])
        layers.append(_layer(name, kind, layer_units, cost, signature, params, param_names,
                             tuple(_call_op(run, i) for i in indices)))
    if unattributed_fwd or unattributed_bwd:
        last_layer = layers[-1]
        layers[-1] = dataclasses.replace(last_layer,
                                         fwd_flops=last_layer.fwd_flops + unattributed_fwd,
                                         bwd_flops=last_layer.bwd_flops + unattributed_bwd)
        notes.append(f"FLOPs of functional code outside modules added to layer "
                     f"`{last_layer.name}`")
    notes += _unused_params_notes(model, owned)
    return layers


def _call_op(run: measure.EagerRun, index: int) -> Op:
    call = run.calls[index]
    target = _module_target(call.module)
    kind = _KIND_BY_TARGET.get(target, OpKind.OTHER)
    param_shapes = tuple(tuple(p.shape) for p in call.module.parameters())
    return Op(name=call.name, fqn=call.fqn, target=target, kind=kind,
              inputs=tuple(run.calls[i].name for i in call.inputs), out_shape=call.out_shape,
              out_bytes=call.out_bytes, fwd_flops=call.fwd_flops, param_shapes=param_shapes,
              attrs=_op_attrs(kind, param_shapes, []))


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
    experts = next((len(m) for name, m in model.named_modules()
                    if name.rsplit(".", 1)[-1] == _EXPERTS_MODULE
                    and isinstance(m, nn.ModuleList)), 0)
    return ModelDims(
        hidden=hidden,
        heads=attention.attrs["heads"] if attention else 0,
        kv_heads=attention.attrs["kv_heads"] if attention else 0,
        layers=len(blocks),
        vocab=embedding.attrs["num_embeddings"] if embedding else 0,
        ffn_hidden=ffn if ffn > hidden else 0,
        experts=experts,
    )
