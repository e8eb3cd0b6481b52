"""BERT family: post-LN encoder with learned positions and token types, masked-LM head."""
from __future__ import annotations

import torch
from torch import nn

from planner.zoo.layers import Attention, Block, GeluMLP, LanguageModel, PositionalEmbedding
from planner.zoo.spec import ModelSpec

# Segment (token type) vocabulary of BERT pre-training: sentence A and B (Devlin et al. 2019).
TOKEN_TYPES = 2


class BertEmbedding(PositionalEmbedding):
    """Token + position + token-type (all type 0) embeddings, then LayerNorm."""

    def __init__(self, vocab: int, hidden: int, max_positions: int):
        super().__init__(vocab, hidden, max_positions)
        self.token_type = nn.Embedding(TOKEN_TYPES, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(tokens) + self.token_type(torch.zeros_like(tokens)))


class MaskedLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> vocabulary projection with bias (BERT's MLM head)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.transform = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(hidden)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.transform(x))))


def build_bert(spec: ModelSpec, max_positions: int) -> LanguageModel:
    """Builds a BERT encoder with its masked-LM head (Devlin et al. 2019), without dropout.

    The loss is taken over every position (no masking): the head runs on all tokens either way
    in a dense implementation. There is no pooler or next-sentence head.

    Args:
        spec: a spec with arch bert.
        max_positions: rows of the learned position table.

    Returns:
        A LanguageModel without a final norm (post-LN blocks end normalised).
    """
    embed = BertEmbedding(spec.vocab, spec.hidden, max_positions)
    layers = [
        Block(Attention(spec.hidden, spec.heads, spec.kv_heads, bias=True, causal=False),
              GeluMLP(spec.hidden, spec.ffn_hidden),
              lambda: nn.LayerNorm(spec.hidden), pre_norm=False)
        for _ in range(spec.layers)
    ]
    head = MaskedLMHead(spec.hidden, spec.vocab)
    if spec.tie_embeddings:
        head.decoder.weight = embed.tok.weight
    return LanguageModel(embed, layers, None, head)
