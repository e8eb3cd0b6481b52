"""The head counts and widths a user's attention module keeps, set to each rank's under tensor parallelism.

Tensor parallelism splits attention by heads through its projections' widths: a rank's q/k/v
hold `heads / tp` heads. The zoo's attention infers its local heads from the tensors. Attention as
users write it often keeps its counts in attributes and views the projections with them
(`q.view(b, s, self.n_heads, -1)`): left whole, a rank's half of the heads would be regrouped into
as many heads of half the width (another model, trained silently), and an output reshaped to
`self.hidden_size` would fail on the first step. `localize_head_counts` sets those attributes to
each rank's, as Megatron's per-partition counts; `check_head_counts` refuses attention that keeps
no count where it can be set.
"""
from __future__ import annotations

from torch import nn

from planner.errors import unsupported
from planner.head_attrs import KEY_VALUE_HEAD_ATTRS, QUERY_HEAD_ATTRS, REPEAT_ATTRS, head_count
from planner.tp_strategies import Placement
from planner.zoo.layers import Attention

# The width of all heads together, which attention code reshapes its output to (Hugging Face's
# `attn_output.reshape(b, s, self.hidden_size)`, OPT's `self.embed_dim`).
WIDTH_ATTRS = ("hidden_size", "embed_dim")


def _split_attention(model: nn.Module, layouts: dict[str, str]):
    """(FQN, module) of each attention split by heads that is not the zoo's."""
    return ((fqn, module) for fqn, module in model.named_modules()
            if layouts.get(fqn) == Placement.HEADS and not isinstance(module, Attention))


def check_head_counts(model: nn.Module, layouts: dict[str, str]) -> None:
    """Refuses attention split by heads that keeps neither a head count (`QUERY_HEAD_ATTRS`) nor a
    `head_dim`: its heads per rank come from somewhere `localize_head_counts` cannot set (a config
    object), so each rank could regroup its share of the heads silently.

    Raises:
        PlannerError: UNSUPPORTED_MODEL naming the module.
    """
    for fqn, module in _split_attention(model, layouts):
        if head_count(module, QUERY_HEAD_ATTRS) is None and not isinstance(getattr(module, "head_dim", None), int):
            raise unsupported(f"module {fqn}: tensor parallelism splits its heads, but it keeps its head count in no "
                              f"attribute Plan.apply can set to each rank's ({', '.join(QUERY_HEAD_ATTRS)}) and has no "
                              f"head_dim; keep the count in one of those attributes, or plan with --tp 1")


def localize_head_counts(model: nn.Module, layouts: dict[str, str], tp: int) -> None:
    """Sets the head counts (`QUERY_HEAD_ATTRS`, `KEY_VALUE_HEAD_ATTRS`, `REPEAT_ATTRS`) and the
    heads' width (`WIDTH_ATTRS`) of each user attention split by heads to each rank's. A rank keeps
    one of fewer key/value heads than tp (`SharedKeyValueParallel`)."""
    for _, module in _split_attention(model, layouts):
        heads, kv_heads = head_count(module, QUERY_HEAD_ATTRS), head_count(module, KEY_VALUE_HEAD_ATTRS)
        local = {QUERY_HEAD_ATTRS: heads and heads // tp, KEY_VALUE_HEAD_ATTRS: kv_heads and max(1, kv_heads // tp)}
        local[REPEAT_ATTRS] = heads and kv_heads and local[QUERY_HEAD_ATTRS] // local[KEY_VALUE_HEAD_ATTRS]
        width = head_count(module, WIDTH_ATTRS)
        local[WIDTH_ATTRS] = width and width % tp == 0 and width // tp
        for names, count in local.items():
            for name in (name for name in names if count and type(getattr(module, name, None)) is int):
                setattr(module, name, count)
