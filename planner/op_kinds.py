"""Classifies traced ops: their OpKind by functional name, and the shape facts the planner reads.

Shared by both capture paths: graph nodes are named by the function or method they call
(`planner.graph_layers`), leaf modules by their functional name, Linear -> linear
(`planner.module_layers`).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the pricing path never imports torch (a cached graph is priced without it)
    from torch import nn

from planner.graph import OpKind

_LOSS_SUFFIX = "_loss"

KIND_BY_TARGET = {
    **dict.fromkeys(("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d",
                     "conv2d", "conv3d", "convolution"), OpKind.MATMUL),
    "scaled_dot_product_attention": OpKind.ATTENTION,
    "embedding": OpKind.EMBEDDING,
    **dict.fromkeys(("layer_norm", "rms_norm", "group_norm", "batch_norm", "batch_norm1d",
                     "batch_norm2d", "batch_norm3d"), OpKind.NORM),
    **dict.fromkeys(("cross_entropy", "nll", "nll_loss", "mse", "mse_loss", "l1", "l1_loss",
                     "binary_cross_entropy"), OpKind.LOSS),
    **dict.fromkeys(("add", "sub", "mul", "truediv", "div", "neg", "pow", "exp", "cos", "sin",
                     "rsqrt", "gelu", "gelu_tanh", "silu", "relu", "tanh", "sigmoid", "softmax",
                     "log_softmax", "dropout", "where", "float", "to"), OpKind.ELEMENTWISE),
}


# Ops that only reinterpret a tensor's shape or strides: no kernel, no memory traffic.
VIEW_TARGETS = frozenset({
    "view", "reshape", "unflatten", "flatten", "transpose", "permute", "t", "unsqueeze", "squeeze",
    "expand", "getitem", "size", "split", "chunk", "narrow", "select", "slice", "unbind", "detach", "alias",
    "view_as", "expand_as",
})

# Indexing by a tensor (`x[index]`, `x[mask]`): a gather kernel that writes a new tensor, unlike
# indexing by ints and slices, which is a view.
GATHER_TARGET = "index"

# Ops that read their tensor input for its shape, dtype and device only (`x.new_zeros(n, h)`,
# `torch.zeros_like(x)`): they write their output and read nothing.
SHAPE_ONLY_TARGETS = frozenset({
    "new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "full_like", "empty_like",
})


# Where `is_causal` sits among the positional arguments of F.scaled_dot_product_attention and of
# aten's op of the same name: (query, key, value, attn_mask, dropout_p, is_causal, ...).
SDPA_IS_CAUSAL_POSITION = 5


def module_target(module: nn.Module) -> str:
    """Functional name of a leaf module: Linear -> linear, CrossEntropyLoss -> cross_entropy."""
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_",
                  type(module).__name__).lower()
    return name.removesuffix(_LOSS_SUFFIX)


def gelu_target(approximate: str) -> str:
    """GELU's target by its approximation. The tanh form (GPT-2's gelu_new) does several times the
    erf form's arithmetic, which sets its time where elementwise math is compute-bound (CPUs), so
    the two are priced from separate measurements."""
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def op_attrs(kind: OpKind, param_shapes: tuple, input_values: list, causal: bool = False) -> dict:
    """Shape facts of an op: features of a linear, heads of attention (and whether the call masks
    causally, `is_causal=True`), vocabulary of an embedding."""
    if kind == OpKind.MATMUL and param_shapes and len(param_shapes[0]) == 2:
        return {"in_features": param_shapes[0][1], "out_features": param_shapes[0][0]}
    if kind == OpKind.ATTENTION and len(input_values) >= 2:
        query, key = input_values[0], input_values[1]
        return {"heads": query.shape[-3], "kv_heads": key.shape[-3], "causal": causal}
    if kind == OpKind.EMBEDDING and param_shapes:
        return {"num_embeddings": param_shapes[0][0], "embedding_dim": param_shapes[0][1]}
    return {}
