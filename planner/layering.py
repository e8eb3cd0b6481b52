"""Groups a model's ops into layers (pipeline-cut units): block detection, layer keys, Layer records.

Layers: the nn.ModuleList / nn.Sequential whose structurally identical children are most
numerous (one will do; they must hold at least `BLOCK_CONTAINER_MIN_PARAM_SHARE` of the weights
outside embedding-shaped vocabulary tables) is the block stack. When that is the root (an
nn.Sequential of an embedding, the blocks and a head), its blocks are its children from the first
to the last of the most common structure.
Ops that run before its first block form the "embed" layer, each block is a layer, and the ops
after the last block (final norm, head, loss) form the "head" layer; functional code between
blocks stays with the block before it, a module between blocks is a layer of its own (kind
OTHER). A model without such a stack gets one layer per top-level child (kind OTHER),
root-level functional code joining the layer that ran before it.

Both capture paths (`planner.graph_layers`, `planner.module_layers`) map each op to the unit it
runs in (`Grouping.unit_of`), key it (`layer_keys`), cut the runs of equal keys into layers
(`layer_runs`) and build each Layer with `make_layer`.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import torch
from torch import nn

from planner.graph import EXPERTS_MODULE, Layer, LayerKind, Op
from planner.measure import PieceCost

# A block stack holds most of a transformer's weights outside its vocabulary tables (embeddings and
# a head of an embedding's shape, which in a small model with a large vocabulary can outweigh all
# blocks); a minor repeated container (two identical conv blocks of a CNN stage, the experts of one
# MoE layer) is not the pipeline-cut axis.
BLOCK_CONTAINER_MIN_PARAM_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Grouping:
    """Maps module FQNs to pipeline-cut units.

    Attributes:
        container: FQN of the block stack ("" when it is the root, e.g. an nn.Sequential of an
            embedding, the blocks and a head), or None.
        outer: FQNs of the container's ancestors ("" is the root); without a container, {""}.
        root_blocks: when the root is the block stack, its children from the first to the last of
            the most common structure (the others are the embedding and the head).
    """

    container: str | None
    outer: frozenset[str]
    root_blocks: frozenset[str] = frozenset()

    @classmethod
    def of(cls, model: nn.Module) -> Grouping:
        container = _find_block_container(model)
        if container is None:
            return cls(None, frozenset({""}))
        if container == "":
            names, signatures = zip(*((name, module_signature(child)) for name, child in model.named_children()))
            common = max(set(signatures), key=signatures.count)
            picked = [i for i, s in enumerate(signatures) if s == common]
            return cls("", frozenset({""}), frozenset(names[picked[0]:picked[-1] + 1]))
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
        if self.container == "":
            return unit in self.root_blocks
        return self.container is not None and unit.startswith(self.container + ".")


def _find_block_container(model: nn.Module) -> str | None:
    """The ModuleList/Sequential with the most structurally identical children (at least one) among
    those whose children hold BLOCK_CONTAINER_MIN_PARAM_SHARE of the parameters outside the
    vocabulary tables."""
    table_shapes = {module.weight.shape for module in model.modules() if isinstance(module, nn.Embedding)}

    def weights(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if p.shape not in table_shapes)

    total = weights(model)
    best, best_count = None, 0
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        signatures = [module_signature(child) for child in module.children()]
        count = max((signatures.count(s) for s in set(signatures)), default=0)
        share = weights(module) / total if total else 0.0
        if count > best_count and share >= BLOCK_CONTAINER_MIN_PARAM_SHARE:
            best, best_count = fqn, count
    return best


def module_signature(module: nn.Module) -> str:
    """Structure of a module: submodule classes and settings, parameter shapes and dtypes."""
    parts = [f"{name}:{type(m).__qualname__}({m.extra_repr()})" for name, m in
             module.named_modules()]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in module.named_parameters()]
    return digest(parts)


def measured_signature(module: nn.Module) -> str:
    """`module_signature` plus which parameters take gradients: modules measured once per key (a
    frozen block costs less backward than its trainable twin, though both are blocks)."""
    return digest([module_signature(module), "".join("1" if p.requires_grad else "0" for p in module.parameters())])


def digest(parts: Sequence[str]) -> str:
    """A short stable hash of `parts` (layer and module signatures)."""
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def layer_keys(units: Sequence[str | None], grouping: Grouping) -> list[tuple[LayerKind, str]]:
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


def layer_runs(items: Sequence, keys: Sequence[tuple[LayerKind, str]]) -> list[tuple[tuple, list]]:
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


def new_tensors(tensors: Sequence[torch.Tensor], owned: set[int]) -> list[torch.Tensor]:
    """Parameters or buffers not owned by an earlier layer (a tied weight counts once, where first used)."""
    fresh = []
    for t in tensors:
        if id(t) not in owned:
            owned.add(id(t))
            fresh.append(t)
    return fresh


def tied_modules(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """FQNs of the modules holding each parameter that more than one module holds (tied weights)."""
    users: dict[int, list[str]] = {}
    for fqn, module in model.named_modules():
        for param in module.parameters(recurse=False):
            users.setdefault(id(param), []).append(fqn)
    return tuple(tuple(fqns) for fqns in users.values() if len(fqns) > 1)


def unused_params_notes(model: nn.Module, owned: set[int]) -> list[str]:
    """A note naming the modules whose parameters no layer owns; empty when every one is used."""
    unused = [name for name, p in model.named_parameters() if id(p) not in owned]
    if not unused:
        return []
    modules = ", ".join(dict.fromkeys(name.rpartition(".")[0] or name for name in unused))
    return [f"{len(unused)} parameter tensors are never used by the traced forward and are in "
            f"no layer: {modules}"]


def make_layer(name: str, kind: LayerKind, fqns: tuple[str, ...], cost: PieceCost,
               signature: str, params: Sequence[nn.Parameter], param_names: dict[int, str],
               ops: tuple[Op, ...], buffers: Sequence[torch.Tensor] = ()) -> Layer:
    """The Layer record of a run of ops: its measured cost and the parameters and buffers it owns."""
    return Layer(
        name=name, kind=kind, fqns=fqns,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        expert_params=sum(p.numel() for p in params
                          if EXPERTS_MODULE in param_names.get(id(p), "").split(".")),
        frozen_params=sum(p.numel() for p in params if not p.requires_grad
                          and EXPERTS_MODULE not in param_names.get(id(p), "").split(".")),
        fwd_flops=cost.fwd_flops, bwd_flops=cost.bwd_flops, saved_bytes=cost.saved_bytes,
        out_bytes=cost.out_bytes, signature=signature, ops=ops, bwd_work_fraction=cost.bwd_work_fraction,
        buffer_bytes=sum(b.numel() * buffer_element_bytes(b) for b in buffers))


# A floating buffer is fp32 in training: a mixed-precision model is built in fp32 and FSDP2 casts
# parameters only (the trace builds the model in the training dtype, so the traced buffer is smaller).
FLOAT_BUFFER_BYTES = 4


def buffer_element_bytes(buffer: torch.Tensor) -> int:
    """Bytes of one element of `buffer` as it is held in training."""
    return max(buffer.element_size(), FLOAT_BUFFER_BYTES) if buffer.is_floating_point() else buffer.element_size()
