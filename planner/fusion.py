"""Elementwise fusion: what a layer's memory-bound ops move when the training code compiles them.

PyTorch eager runs every elementwise op, norm and concatenation as its own kernel, each reading its
inputs from device memory and writing its output back (what `layer_cost` prices op by op). A
compiler (torch.compile's Inductor) or a fused-kernel library (NVIDIA Transformer Engine's fused
norm, rotary and SwiGLU kernels) runs each chain of such ops between two GEMMs as one kernel: the
chain reads each tensor it takes from outside once and writes only the tensors used outside it;
its intermediates stay on chip.

A fused region is a connected group of the layer's memory-bound ops (`FUSIBLE_KINDS`, views
included since they move nothing), joined by the graph's data edges. Its forward traffic is the
bytes of its distinct outside inputs plus the bytes of its outputs read outside the region (or by
no op of the layer: the layer's output); its backward moves `MEMORY_BWD_TRAFFIC_RATIO` times that,
as an eager op's does (reading output gradients and the region's inputs, writing input gradients;
Inductor recomputes the cheap intermediates rather than saving them), counting only the tensors
read or written by members whose output takes a gradient (integer bookkeeping has no backward).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from costmodel.compute import FP8_CAST_TRAFFIC_RATIO, MEMORY_BWD_TRAFFIC_RATIO, OpWork, WorkKind
from planner.graph import Op, OpKind
from planner.op_kinds import VIEW_TARGETS

# Op kinds a compiler fuses into one kernel: elementwise ops, norms, and the zero-FLOP reshuffles
# traced as OTHER (cat, repeat, arange). Matmuls, attention, embedding lookups and the loss keep
# their own kernels.
FUSIBLE_KINDS = frozenset({OpKind.ELEMENTWISE, OpKind.NORM, OpKind.OTHER})

# fp8 cast of a GEMM operand under fusion: the amax reduction of dynamic scaling runs inside the
# kernel that produces the operand (Inductor fuses it into the preceding elementwise kernel, as
# Transformer Engine fuses it into its norm and activation kernels), leaving one pass that reads
# the bf16 tensor (2 B per element) and writes fp8 (1 B): 1.5 times the operand's bf16 bytes,
# against the separate amax read and cast of eager (FP8_CAST_TRAFFIC_RATIO, 2.5).
FP8_FUSED_CAST_TRAFFIC_RATIO = 1.5

# Work key of a fused region: no measured op table times one, so it is priced by the roofline.
FUSED_REGION_KEY = "fused_region"


class ElementwiseKernels(StrEnum):
    """How the training code runs memory-bound ops: "eager", one kernel per op (PyTorch eager; what
    the trace records), or "fused", each chain between GEMMs in one kernel (torch.compile,
    Transformer Engine)."""

    EAGER = "eager"
    FUSED = "fused"

    @property
    def cast_traffic_ratio(self) -> float:
        """Bytes an fp8 GEMM's operand cast moves, in multiples of the operand's bf16 bytes."""
        return FP8_FUSED_CAST_TRAFFIC_RATIO if self is ElementwiseKernels.FUSED else FP8_CAST_TRAFFIC_RATIO


@dataclass(frozen=True)
class FusedRegion:
    """One fused kernel of a layer.

    Attributes:
        members: names of the layer's ops it runs (views included).
        reads: (member op, bytes) per distinct tensor it reads from outside, charged at the split of
            the member that reads it.
        writes: (member op, bytes) per member output used outside the region.
    """

    members: frozenset[str]
    reads: tuple[tuple[str, float], ...]
    writes: tuple[tuple[str, float], ...]


def fusible(op: Op) -> bool:
    return op.kind in FUSIBLE_KINDS and op.fwd_flops == 0


@lru_cache(maxsize=1024)
def fused_regions(ops: tuple[Op, ...]) -> tuple[FusedRegion, ...]:
    """The fused kernels of a layer whose op graph is `ops` (see the module docstring)."""
    by_name = {op.name: op for op in ops}
    root = {op.name: op.name for op in ops if fusible(op)}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    for name in root:
        for producer in by_name[name].inputs:
            if producer in root:
                root[find(producer)] = find(name)
    consumers: dict[str, list[str]] = {}
    for op in ops:
        for producer in op.inputs:
            consumers.setdefault(producer, []).append(op.name)
    groups: dict[str, set[str]] = {}
    for name in root:
        groups.setdefault(find(name), set()).add(name)
    regions = []
    for members in groups.values():
        if all(by_name[name].target in VIEW_TARGETS for name in members):
            continue  # views only: no kernel
        reads: dict[str, tuple[str, float]] = {}
        for name in sorted(members):
            for producer in by_name[name].inputs:
                if producer not in members and (producer not in reads or by_name[name].takes_grad
                                                and not by_name[reads[producer][0]].takes_grad):
                    # An input from outside the layer is taken to be the size of the reader's output;
                    # a tensor read by several members is charged to one that takes a gradient, if any.
                    size = by_name[producer].out_bytes if producer in by_name else by_name[name].out_bytes
                    reads[producer] = (name, float(size))
        writes = tuple((name, float(by_name[name].out_bytes)) for name in sorted(members)
                       if any(user not in members for user in consumers.get(name, ["<layer output>"])))
        regions.append(FusedRegion(frozenset(members), tuple(reads.values()), writes))
    return tuple(regions)


def fused_works(ops: tuple[Op, ...], share: float, split_of: Callable[[Op], int]) -> tuple[frozenset[str], list[OpWork], list[OpWork]]:
    """The ops a layer's fused kernels run, and the kernels' forward and backward works at `share` of
    the traced micro-batch; each tensor is divided by the tensor-parallel split (`split_of`) of the
    member op that reads or writes it."""
    by_name = {op.name: op for op in ops}
    members: set[str] = set()
    fwd, bwd = [], []
    for region in fused_regions(ops):
        members |= region.members
        moved = [(by_name[name], size) for name, size in region.reads + region.writes]
        traffic = share * sum(size / split_of(op) for op, size in moved)
        graded = share * sum(size / split_of(op) for op, size in moved if op.takes_grad)
        fwd.append(OpWork(WorkKind.MEMORY, 0.0, traffic, FUSED_REGION_KEY))
        bwd.append(OpWork(WorkKind.MEMORY, 0.0, MEMORY_BWD_TRAFFIC_RATIO * graded, f"{FUSED_REGION_KEY}:bwd"))
    return frozenset(members), fwd, bwd
