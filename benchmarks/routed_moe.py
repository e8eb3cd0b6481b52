"""A model whose routing neither torch.fx nor torch.export can capture, for `trace_speed.py`.

Its MoE layers dispatch tokens as Hugging Face's Mixtral does: one loop over the experts, each
taking the tokens `torch.where` picks for it. Those data-dependent shapes send the trace to its
module-level fallback, an eager run on CPU tensors with real weights in the training dtype.
Referenced as `benchmarks.routed_moe:routed_moe_lm` from the repository root.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

HIDDEN, HEADS, EXPERTS, TOP_K, EXPERT_HIDDEN, LAYERS, VOCAB = 512, 8, 8, 2, 1024, 4, 32000


class RoutedMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, EXPERT_HIDDEN, bias=False), nn.SiLU(),
                                                   nn.Linear(EXPERT_HIDDEN, HIDDEN, bias=False)) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)
        weights, chosen = self.router(tokens).softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            out.index_add_(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.moe = RoutedMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        return x + self.moe(self.norm2(x))


def routed_moe_lm() -> nn.Module:
    """Embedding, LAYERS `Block`s, a norm and a head: returns logits."""
    return nn.Sequential(nn.Embedding(VOCAB, HIDDEN), *(Block() for _ in range(LAYERS)), nn.RMSNorm(HIDDEN),
                         nn.Linear(HIDDEN, VOCAB, bias=False))
