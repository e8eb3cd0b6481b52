"""Layers of a captured fx / export graph, each layer measured as a standalone piece.

Values propagate on meta layer by layer. Each layer's nodes are cut out of the graph as a
standalone GraphModule and measured (`planner.measure.measure_piece`) once per layer signature
(ops, module structure, parameter and input shapes), so a 126-block model measures one block.
Every node with a tensor output becomes an `Op`.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from planner import measure
from planner.graph import Layer, LayerKind, Op, OpKind
from planner.layering import (Grouping, digest, layer_keys, layer_runs, make_layer, measured_signature, new_tensors,
                              unused_params_notes)
from planner.op_kinds import (GATHER_TARGET, KIND_BY_TARGET, SDPA_IS_CAUSAL_POSITION, SHAPE_ONLY_TARGETS, gelu_target,
                              module_target, op_attrs)

_CALL_OPS = ("call_function", "call_method", "call_module")


def graph_layers(root: nn.Module, graph: fx.Graph, model: nn.Module, inputs: tuple,
                 grouping: Grouping, notes: list[str]) -> list[Layer]:
    """Layers of a captured graph. Values propagate on meta layer by layer; a layer whose
    signature (which covers its input shapes) was seen before reuses that layer's node values,
    FLOPs and measurement instead of running."""
    interpreter = fx.Interpreter(root, graph=graph)
    values = interpreter.env
    values.update(zip([n for n in graph.nodes if n.op == "placeholder"], inputs))
    values.update({n: _fetch_attr(root, n.target) for n in graph.nodes if n.op == "get_attr"})
    nodes = [n for n in graph.nodes if n.op in _CALL_OPS]
    keys = layer_keys([grouping.unit_of(_node_fqn(n)) for n in nodes], grouping)
    flops: dict[fx.Node, int] = {}
    first_seen: dict[str, list[fx.Node]] = {}
    costs: dict[str, measure.PieceCost] = {}
    param_names = {id(p): name for name, p in model.named_parameters()}
    owned: set[int] = set()
    owned_buffers: set[int] = set()
    # Nodes a gradient reaches in training: floating values computed from a trainable parameter.
    # A layer input outside them (a model input, rotary angles from buffers) is data, not an activation.
    flowing = {n for n in graph.nodes if n.op == "get_attr" and getattr(values[n], "requires_grad", False)}
    layers = []
    for (kind, name), layer_nodes in layer_runs(nodes, keys):
        signature = _graph_signature(root, kind, layer_nodes, values, flowing)
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
                    data_args=frozenset(i for i, n in enumerate(piece_inputs) if n not in flowing))
            except Exception as exc:  # noqa: BLE001 - user code may raise anything
                raise measure.ModuleRunError(name) from exc
        params = new_tensors(_node_params(root, layer_nodes), owned)
        buffers = new_tensors(_node_buffers(root, layer_nodes), owned_buffers)
        _mark_flowing(root, layer_nodes, values, flowing)
        ops = tuple(op for n in layer_nodes if (op := _graph_op(root, n, values, flops)))
        layers.append(make_layer(name, kind, _units(grouping, layer_nodes, model), costs[signature],
                                 signature, params, param_names, ops, buffers))
    _check_output_takes_grad(graph, values, model)
    notes += unused_params_notes(model, owned)
    return layers


def _check_output_takes_grad(graph: fx.Graph, values: dict, model: nn.Module) -> None:
    """Raises NoGradOutputError when a model with trainable parameters returns no floating tensor
    (None, indices, a mask): no gradient can flow back from its output, so nothing trains. Values
    propagate without autograd here, so a floating output stands for one that takes a gradient."""
    output = next(node for node in graph.nodes if node.op == "output")
    value = fx.node.map_arg(output.args[0], lambda node: values.get(node))
    if not any(t.is_floating_point() for t in measure.tensor_leaves(value)) and any(p.requires_grad for p in model.parameters()):
        raise measure.NoGradOutputError(f"a tensor of {str(value.dtype).removeprefix('torch.')}" if isinstance(value, torch.Tensor)
                                        else type(value).__name__ if value is not None else "None")


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


def _units(grouping: Grouping, nodes: Sequence[fx.Node], model: nn.Module) -> tuple[str, ...]:
    """The block or top-level module FQNs of `model` a layer's nodes run in, in run order (modules
    the capture added, such as torch.export's `_guards_fn`, are not the model's)."""
    return tuple(dict.fromkeys(u for n in nodes
                               if (u := grouping.unit_of(_node_fqn(n))) is not None and _is_submodule(model, u)))


def _is_submodule(model: nn.Module, fqn: str) -> bool:
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True


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


def _mark_flowing(root: nn.Module, nodes: Sequence[fx.Node], values: dict, flowing: set[fx.Node]) -> None:
    """Adds to `flowing` (the earlier nodes a gradient reaches) the `nodes`, in graph order, it
    reaches: a floating output of a module with trainable parameters, or of an op reading such a node."""
    for node in nodes:
        trains = node.op == "call_module" and any(p.requires_grad for p in root.get_submodule(node.target).parameters())
        floating = any(t.is_floating_point() for t in measure.tensor_leaves(values[node]))
        if floating and (trains or any(arg in flowing for arg in node.all_input_nodes)):
            flowing.add(node)


def _graph_signature(root: nn.Module, kind: LayerKind, nodes: Sequence[fx.Node],
                     values: dict, flowing: set[fx.Node]) -> str:
    """Structural key: op targets, module settings, parameter and input shapes, constants, and
    which inputs a gradient reaches (`flowing`)."""
    local = {n: i for i, n in enumerate(nodes)}

    def describe(arg):
        if not isinstance(arg, fx.Node):
            return arg
        if arg in local:
            return f"%{local[arg]}"
        return _shape_of(values[arg]), arg in flowing

    parts = [str(kind)]
    for node in nodes:
        target = node.target
        if node.op == "call_module":
            target = measured_signature(root.get_submodule(node.target))
        parts.append(f"{node.op}:{getattr(target, '__qualname__', target)}:"
                     f"{fx.node.map_aggregate((node.args, node.kwargs), describe)}")
    return digest(parts)


def _shape_of(value) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.requires_grad)
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


def _node_buffers(root: nn.Module, nodes: Sequence[fx.Node]) -> list[torch.Tensor]:
    """Buffers the nodes read: those of the modules they call and those fetched by get_attr."""
    buffers = []
    for node in nodes:
        if node.op == "call_module":
            buffers += root.get_submodule(node.target).buffers()
        buffers += [t for a in node.all_input_nodes if a.op == "get_attr"
                    and isinstance(t := _fetch_attr(root, a.target), torch.Tensor) and not isinstance(t, nn.Parameter)]
    return buffers


def _graph_op(root: nn.Module, node: fx.Node, values: dict, flops: dict) -> Op | None:
    value = values[node]
    out = _first_tensor(value)
    if out is None:
        return None
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        target = module_target(module)
        param_shapes = tuple(tuple(p.shape) for p in module.parameters())
    else:
        target = GATHER_TARGET if _indexes_by_tensor(node, values) else _function_target(node)
        param_shapes = tuple(tuple(p.shape) for a in node.all_input_nodes if a.op == "get_attr"
                             and isinstance(p := _fetch_attr(root, a.target), nn.Parameter))
    if target == "gelu":
        approximate = module.approximate if node.op == "call_module" else node.kwargs.get("approximate", "none")
        target = gelu_target(approximate)
    kind = KIND_BY_TARGET.get(target, OpKind.OTHER)
    attrs = op_attrs(kind, param_shapes, [values[a] for a in node.all_input_nodes if a.op != "get_attr"],
                     causal=kind == OpKind.ATTENTION and _is_causal(node))
    reads = () if target in SHAPE_ONLY_TARGETS else node.all_input_nodes
    return Op(name=node.name, fqn=_node_fqn(node), target=target, kind=kind,
              inputs=tuple(a.name for a in reads if a.op in _CALL_OPS and _first_tensor(values[a]) is not None),
              out_shape=tuple(out.shape),
              out_bytes=sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
                            if isinstance(t, torch.Tensor)),
              fwd_flops=float(flops[node]), param_shapes=param_shapes, attrs=attrs,
              takes_grad=out.is_floating_point())


def _is_causal(node: fx.Node) -> bool:
    """Whether an attention call masks causally by its `is_causal` flag, given as the constant True (a
    causal mask passed as a tensor does not count: a kernel given a mask computes every score; nor
    does a flag the graph computes, whose value the trace does not know)."""
    if "is_causal" in node.kwargs:
        return node.kwargs["is_causal"] is True
    return len(node.args) > SDPA_IS_CAUSAL_POSITION and node.args[SDPA_IS_CAUSAL_POSITION] is True


def _indexes_by_tensor(node: fx.Node, values: dict) -> bool:
    """Whether `node` is `x[index]` with a tensor among its indices (a gather, not a view)."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) < 2:
        return False
    indices = pytree.tree_leaves(node.args[1])
    return isinstance(values.get(node.args[0]), torch.Tensor) and any(
        isinstance(index, fx.Node) and isinstance(values.get(index), torch.Tensor) for index in indices)


def _first_tensor(value: object) -> torch.Tensor | None:
    return next((t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)), None)


def _function_target(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))
