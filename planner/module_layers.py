"""Layers of the module-level fallback: one op per leaf-module call of an eager run.

The whole model is measured in one eager run (`planner.eager_run`); FLOPs and saved bytes are
attributed to layers by module, and the FLOPs of functional code outside every module go to the
last layer.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from planner.eager_run import EagerRun
from planner.graph import Layer, Op, OpKind, Recompute
from planner.layering import (Grouping, digest, layer_keys, layer_runs, make_layer, measured_signature, new_tensors,
                              unused_params_notes)
from planner.measure import PieceCost
from planner.op_kinds import KIND_BY_TARGET, module_target, op_attrs


def module_layers(run: EagerRun, model: nn.Module, grouping: Grouping,
                  notes: list[str]) -> list[Layer]:
    """Layers of an eager run: its leaf calls grouped by `grouping`, costs attributed by module;
    appends notes about unattributed FLOPs and unused parameters to `notes`."""
    units = [grouping.unit_of(call.fqn) for call in run.calls]
    keys = layer_keys(units, grouping)
    param_names = {id(p): name for name, p in model.named_parameters()}
    owned: set[int] = set()
    owned_buffers: set[int] = set()
    unattributed_fwd, unattributed_bwd = run.module_flops[""]
    layers = []
    for (kind, name), indices in layer_runs(range(len(run.calls)), keys):
        layer_units = tuple(dict.fromkeys(units[i] for i in indices if units[i] is not None))
        fwd = float(sum(run.module_flops[u][0] for u in layer_units))
        bwd = float(sum(run.module_flops[u][1] for u in layer_units))
        unattributed_fwd, unattributed_bwd = unattributed_fwd - fwd, unattributed_bwd - bwd
        first, last = indices[0], indices[-1]
        # Tensors saved before the first leaf call (index -1) belong to the first layer.
        saved = run.saved_bytes(lambda i: first <= max(i, 0) <= last)
        saved[Recompute.FULL] = run.in_bytes[layer_units[0]] if layer_units else 0
        cost = PieceCost(fwd_flops=fwd, bwd_flops=bwd, saved_bytes=saved,
                         in_bytes=saved[Recompute.FULL],
                         out_bytes=run.out_bytes[layer_units[-1]] if layer_units else 0)
        params = new_tensors([p for u in layer_units
                              for p in model.get_submodule(u).parameters()], owned)
        buffers = new_tensors([b for u in layer_units for b in model.get_submodule(u).buffers()], owned_buffers)
        signature = digest([str(kind)] + [measured_signature(model.get_submodule(u))
                                         for u in layer_units])
        layers.append(make_layer(name, kind, layer_units, cost, signature, params, param_names,
                                 tuple(_call_op(run, i) for i in indices), buffers))
    if unattributed_fwd or unattributed_bwd:
        last_layer = layers[-1]
        layers[-1] = dataclasses.replace(last_layer,
                                         fwd_flops=last_layer.fwd_flops + unattributed_fwd,
                                         bwd_flops=last_layer.bwd_flops + unattributed_bwd)
        notes.append(f"FLOPs of functional code outside modules added to layer "
                     f"`{last_layer.name}`")
    notes += unused_params_notes(model, owned)
    return layers


def _call_op(run: EagerRun, index: int) -> Op:
    call = run.calls[index]
    target = module_target(call.module)
    kind = KIND_BY_TARGET.get(target, OpKind.OTHER)
    param_shapes = tuple(tuple(p.shape) for p in call.module.parameters())
    return Op(name=call.name, fqn=call.fqn, target=target, kind=kind,
              inputs=tuple(run.calls[i].name for i in call.inputs), out_shape=call.out_shape,
              out_bytes=call.out_bytes, fwd_flops=call.fwd_flops, param_shapes=param_shapes,
              attrs=op_attrs(kind, param_shapes, []))
