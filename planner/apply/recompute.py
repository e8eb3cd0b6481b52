"""Activation checkpointing on exactly the layers the plan's memory plan names.

- `full`: the whole unit (a block) is wrapped with `checkpoint_wrapper`; only its input is kept
  and its forward runs again in backward.
- `selective`: the block's attention module (its child named in ATTENTION_CHILDREN) is
  checkpointed with selective activation checkpointing that keeps the matmul and collective
  outputs up to the attention kernel and recomputes everything else inside it (rotary embedding,
  head reshapes and the attention core).
  This is Korthikanti et al.'s attention-core recompute; it keeps the q/k/v projection outputs
  rather than exactly the core inputs, so it holds about one (batch x seq x hidden) tensor per
  layer less than the planner's SELECTIVE measurement when the core saves its output. What follows
  the kernel (the output projection and, under tensor parallelism, its reduction) is left to
  recompute: its backward reads only the kernel's output, so the recompute, which stops once the
  backward has what it reads (non-reentrant checkpointing's early stop), never runs it, and the
  output projection's partial sums (whole on every tp rank) are not kept.
- `selective_op`: the whole block is checkpointed with torchtitan's op-level policy
  (`planner.op_sac`): attention-kernel outputs and every other `aten.mm` output are kept, the rest
  runs again in backward.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from planner.graph import Recompute
from planner.errors import unsupported
from planner.op_sac import ATTENTION_OPS, OpSacCounter

# Names of the child of a block that holds its attention, the first a block has: the zoo's and GPT-2's
# `attn`, Hugging Face decoders' and torch's encoder/decoder layers' `self_attn`, BERT's `attention`,
# Megatron's `self_attention`.
ATTENTION_CHILDREN = ("attn", "self_attn", "attention", "self_attention")

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
# Ops whose outputs selective recompute keeps: GEMMs (expensive to redo) and collectives
# (recomputing them would repeat communication).
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._scaled_mm.default,
    _c10d.all_reduce.default, _c10d.reduce_scatter_tensor.default, _c10d.all_gather_into_tensor.default,
    _c10d.all_to_all_single.default,
})


def selective_policy():
    """The selective policy of one run of an attention module: its forward and its recompute each keep
    `SAVED_OPS` outputs until their attention kernel runs, nothing after it (module docstring)."""
    past_kernel = {False: False, True: False}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        past_kernel[ctx.is_recompute] |= func in ATTENTION_OPS
        keep = func in SAVED_OPS and not past_kernel[ctx.is_recompute]
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy())


def _op_sac_contexts():
    """Checkpoint contexts of one run of a block: fresh counters for its forward and its recompute."""
    counters = {False: OpSacCounter(), True: OpSacCounter()}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        keep = counters[ctx.is_recompute].keeps(func)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _replace(root: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def apply_recompute(root: nn.Module, memory_plan: dict, units: tuple[str, ...]) -> dict[str, Recompute]:
    """Wraps the units of `root` (FQNs as in the plan) that the memory plan recomputes.

    Args:
        root: the local module (whole model or a pipeline chunk keeping the model's FQNs).
        memory_plan: `Plan.memory_plan` ({"recompute": {policy: [layer names]}, ...}).
        units: the units present in `root`; layers elsewhere are skipped.

    Returns:
        Unit FQN -> policy applied, for the units that recompute.

    Raises:
        PlannerError: UNSUPPORTED_MODEL when a selective layer has no attention child.
    """
    applied: dict[str, Recompute] = {}
    for policy, names in memory_plan.get("recompute", {}).items():
        policy = Recompute(policy)
        for name in names:
            if policy == Recompute.NONE or name not in units:
                continue
            if policy == Recompute.FULL:
                _replace(root, name, checkpoint_wrapper(root.get_submodule(name)))
            elif policy == Recompute.SELECTIVE_OP:
                _replace(root, name, checkpoint_wrapper(root.get_submodule(name), context_fn=_op_sac_contexts))
            else:
                fqn = _attention_of(root, name)
                _replace(root, fqn, checkpoint_wrapper(root.get_submodule(fqn), context_fn=_selective_contexts))
            applied[name] = policy
    return applied


def check_recompute(model: nn.Module, memory_plan: dict) -> None:
    """Raises PlannerError (UNSUPPORTED_MODEL) when a layer the memory plan recomputes selectively has
    no attention child to recompute."""
    for name in memory_plan.get("recompute", {}).get(str(Recompute.SELECTIVE), []):
        _attention_of(model, name)


def _attention_of(root: nn.Module, layer: str) -> str:
    children = dict(root.get_submodule(layer).named_children())
    name = next((name for name in ATTENTION_CHILDREN if name in children), None)
    if name is None:
        raise unsupported(f"recompute: layer {layer} has no attention child ({', '.join(ATTENTION_CHILDREN)}) for "
                          f"selective recompute; re-plan with --recompute full or none")
    return f"{layer}.{name}"
