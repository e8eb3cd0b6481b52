"""GPT-2/GPT-3 family: learned positions, pre-LN blocks, tanh-GELU MLP, biases everywhere."""
from __future__ import annotations

from torch import nn

from planner.zoo.layers import Attention, Block, GeluMLP, LanguageModel, PositionalEmbedding
from planner.zoo.spec import ModelSpec


def build_gpt(spec: ModelSpec, max_positions: int) -> LanguageModel:
    """Builds a GPT decoder (Radford et al. 2019; Brown et al. 2020) without dropout.

    Args:
        spec: a spec with arch gpt.
        max_positions: rows of the learned position table.

    Returns:
        A LanguageModel whose `head` shares `embed.tok.weight` when `spec.tie_embeddings`.
    """
    embed = PositionalEmbedding(spec.vocab, spec.hidden, max_positions)
    layers = [
        Block(Attention(spec.hidden, spec.heads, spec.kv_heads, bias=True, causal=True),
              GeluMLP(spec.hidden, spec.ffn_hidden, approximate="tanh"),
              lambda: nn.LayerNorm(spec.hidden))
        for _ in range(spec.layers)
    ]
    head = nn.Linear(spec.hidden, spec.vocab, bias=False)
    if spec.tie_embeddings:
        head.weight = embed.tok.weight
    return LanguageModel(embed, layers, nn.LayerNorm(spec.hidden), head)
