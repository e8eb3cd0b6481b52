"""Llama family: RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, no biases."""
from __future__ import annotations

from typing import Callable

from torch import nn

from planner.zoo.layers import RMS_NORM_EPS, Attention, Block, LanguageModel, SwiGLU
from planner.zoo.spec import ModelSpec


def build_llama(spec: ModelSpec) -> LanguageModel:
    """Builds a Llama decoder (Touvron et al. 2023; Llama 3, Dubey et al. 2024).

    Args:
        spec: a spec with arch llama.

    Returns:
        A LanguageModel; rotary embeddings need no table, so any sequence length traces.
    """
    return build_rope_decoder(spec, lambda _: SwiGLU(spec.hidden, spec.ffn_hidden))


def build_rope_decoder(spec: ModelSpec, make_mlp: Callable[[int], nn.Module]) -> LanguageModel:
    """Builds the Llama skeleton with a per-layer feed-forward module (dense or MoE).

    Args:
        spec: a spec with arch llama or moe.
        make_mlp: layer index -> that layer's feed-forward module.

    Returns:
        A LanguageModel with an untied head unless `spec.tie_embeddings`.
    """
    embed = nn.Embedding(spec.vocab, spec.hidden)
    layers = [
        Block(Attention(spec.hidden, spec.heads, spec.kv_heads, bias=False, causal=True,
                        rope_theta=spec.rope_theta, head_dim=spec.head_dim),
              make_mlp(index),
              lambda: nn.RMSNorm(spec.hidden, eps=RMS_NORM_EPS))
        for index in range(spec.layers)
    ]
    head = nn.Linear(spec.hidden, spec.vocab, bias=False)
    if spec.tie_embeddings:
        head.weight = embed.weight
    return LanguageModel(embed, layers, nn.RMSNorm(spec.hidden, eps=RMS_NORM_EPS), head)
