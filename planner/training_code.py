"""How the user's training code runs the parts a parallel configuration does not decide.

Two programs with the same model and configuration can differ in their kernels and in how they
synchronise model states; the cost model prices whichever the user names. `TrainingCode` holds
those choices, each with PyTorch's or FSDP2's behaviour (what `Plan.apply` runs) as its default:

| field | choices (default first) | priced in |
|-------|-------------------------|-----------|
| attention | flash, flash2, flash1, unfused | `planner.op_works.AttentionKernel` |
| tp_overlap | none, full, forward | `planner.layer_comm.TpOverlap` (true and false, its switch of old, mean full and none) |
| loss | torch, inplace, fused | `planner.loss_cost.LossKernel` |
| zero3_fetch | prefetch, blocking | `planner.state_cost.Zero3Fetch` |
| dp_sync | overlapped, blocking | `planner.state_cost.DpSync` |
| elementwise | eager, fused | `planner.fusion.ElementwiseKernels` |
| pp_buffers | preallocated, transient | `planner.pipeline_buffers.PipeBuffers` |
| cp_comm | all_gather, a2a | `planner.layer_comm.CpComm` |
| sp_gather | kept, regathered | `planner.sp_gather.SpGather` |
| pp_outputs | dropped, kept | `planner.pipeline_buffers.PipeOutputs` |
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum

from planner.errors import invalid
from planner.fusion import ElementwiseKernels
from planner.layer_comm import CpComm, TpOverlap
from planner.op_works import AttentionKernel
from planner.loss_cost import LossKernel
from planner.pipeline_buffers import PipeBuffers, PipeOutputs
from planner.sp_gather import SpGather
from planner.state_cost import DpSync, Zero3Fetch


# Choices besides each field's default that `Plan.apply` runs: torch picks the attention kernel
# (`flash2` is PyTorch's SDPA on Hopper up to torch 2.10), and context parallelism runs either exchange.
APPLIED_BESIDES_DEFAULTS = {"attention": ("flash2",), "cp_comm": ("a2a",)}

# Values a field took when it was a switch (true/false), as the choices they mean.
SWITCH_VALUES = {"tp_overlap": {True: TpOverlap.FULL.value, False: TpOverlap.NONE.value}}


@dataclass(frozen=True)
class TrainingCode:
    """The training code's kernels and state synchronisation (module docstring)."""

    attention: AttentionKernel = AttentionKernel.FLASH
    tp_overlap: TpOverlap = TpOverlap.NONE
    loss: LossKernel = LossKernel.TORCH
    zero3_fetch: Zero3Fetch = Zero3Fetch.PREFETCH
    dp_sync: DpSync = DpSync.OVERLAPPED
    elementwise: ElementwiseKernels = ElementwiseKernels.EAGER
    pp_buffers: PipeBuffers = PipeBuffers.PREALLOCATED
    cp_comm: CpComm = CpComm.ALL_GATHER
    sp_gather: SpGather = SpGather.KEPT
    pp_outputs: PipeOutputs = PipeOutputs.DROPPED

    def __post_init__(self):
        """Plain values become their choice's enum member (`TrainingCode(loss="fused")`), which the
        cost model compares by identity; an unknown one raises ValueError (`of` says more)."""
        for f in fields(self):
            value = unswitched(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, type(getattr(type(self), f.name))(value))

    @classmethod
    def of(cls, **choices) -> TrainingCode:
        """The training code with `choices` (field names; enum values or their strings) and the
        defaults for the rest.

        Raises:
            PlannerError: INVALID_INPUT naming the field and its choices, for an unknown field or value.
        """
        names = [f.name for f in fields(cls)]
        values = {}
        for name, value in choices.items():
            if name not in names:
                raise invalid(f"{name}: not a training-code choice; use {', '.join(names)}")
            kind = type(getattr(cls, name))
            try:
                values[name] = kind(unswitched(name, value))
            except ValueError:
                raise invalid(f"{name}={value!r}: use one of {', '.join(repr(k.value) for k in kind)}") from None
        return cls(**values)

    def options(self) -> dict[str, str]:
        """Every field as plain values, in field order: the keyword arguments of `planner.plan`."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def changed(self) -> dict[str, str]:
        """`options` that differ from the defaults."""
        default = TrainingCode().options()
        return {name: value for name, value in self.options().items() if value != default[name]}

    def not_applied(self) -> dict[str, str]:
        """`changed` choices that `Plan.apply` does not run: it runs PyTorch's and FSDP2's own."""
        return {name: value for name, value in self.changed().items() if value not in APPLIED_BESIDES_DEFAULTS.get(name, ())}

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...]:
        """The plain values field `name` takes, its default first."""
        return tuple(kind.value for kind in type(getattr(cls, name)))


def unswitched(name: str, value):
    """`value`, or the choice it means where field `name` was a switch and `value` is true or false."""
    return SWITCH_VALUES[name][value] if isinstance(value, bool) and name in SWITCH_VALUES else value


def _plain(value: StrEnum) -> str:
    return value.value
