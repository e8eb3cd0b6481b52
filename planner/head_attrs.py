"""The attributes attention code keeps its head counts in (nanoGPT, torchtitan, Hugging Face,
`nn.MultiheadAttention`): the trace reads a model's heads from them where no scaled-dot-product
attention call shows them, and `Plan.apply` sets them to each rank's share."""
from __future__ import annotations

from torch import nn

QUERY_HEAD_ATTRS = ("heads", "n_head", "n_heads", "num_heads", "num_attention_heads")
KEY_VALUE_HEAD_ATTRS = ("kv_heads", "n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")
REPEAT_ATTRS = ("n_rep", "num_key_value_groups")  # query heads per key/value head (torchtitan, Hugging Face)


def head_count(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first of the head-count attributes `names` the module has (an int; booleans are not counts)."""
    return next((count for name in names
                 if isinstance(count := getattr(module, name, None), int) and not isinstance(count, bool)), None)
