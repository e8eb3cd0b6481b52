"""Building blocks shared by the zoo families: attention, MLPs, transformer block, language model.

Everything here is built on the ambient default device and dtype (the tracer sets
`torch.device("meta")` or FakeTensorMode with a bf16 default), traces with `torch.fx` (no Python
control flow on tensor values, shapes only through tensor methods) and is laid out for tensor
parallelism: separate q/k/v/o projections and separate MLP projections, head counts inferred
from the projection widths in forward so column-sharded projections work unchanged.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Standard deviation for weights that nn modules do not initialise themselves (GPT-2, Radford
# et al. 2019; also ViT position embeddings). On meta and fake tensors initialisation is free.
INIT_STD = 0.02
# RMSNorm epsilon of Llama 2 and Llama 3 (`norm_eps` in Meta's params.json).
RMS_NORM_EPS = 1e-5


class Attention(nn.Module):
    """Multi-head self-attention with optional grouped-query heads and rotary embeddings.

    Args:
        hidden: model width.
        heads: query heads.
        kv_heads: key/value heads; must divide `heads`.
        bias: whether the four projections have biases (GPT, BERT, ViT) or not (Llama).
        causal: mask future positions (decoders).
        rope_theta: rotary embedding base, or None for no rotary embedding.
        head_dim: width of one head; None for hidden / heads. The query projection is heads x
            head_dim wide and the key/value projections kv_heads x head_dim, whatever `hidden` is.

    Context parallelism (`planner.apply.context_parallel`) sets `positions`, the positions of this
    rank's tokens in the sequence (None: 0..s-1), and replaces `attend`.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, *, bias: bool, causal: bool,
                 rope_theta: float | None = None, head_dim: int | None = None):
        super().__init__()
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim or hidden // heads
        self.causal = causal
        self.rope_theta = rope_theta
        self.positions: torch.Tensor | None = None
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x))
        if self.rope_theta is not None:
            q = apply_rope(q, self.rope_theta, self.positions)
            k = apply_rope(k, self.rope_theta, self.positions)
        out = self.attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention over (b, heads, s, head_dim) queries, keys and values."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.kv_heads != self.heads)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, n * head_dim) -> (b, n, s, head_dim)."""
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)


def apply_rope(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotates (b, heads, s, head_dim) by position-dependent angles (Su et al. 2021).

    The angles are computed from the tokens' positions (`arange(s)` unless given) in forward (no
    cached table), in float32, using the rotate-half layout of Hugging Face Llama.
    """
    seq_len, head_dim = x.shape[-2], x.shape[-1]
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32)
                          / head_dim)
    if positions is None:
        positions = torch.arange(seq_len, device=x.device, dtype=torch.float32)
    else:
        positions = positions.to(device=x.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq).repeat(1, 2)
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * angles.cos().to(x.dtype) + rotated * angles.sin().to(x.dtype)


class GeluMLP(nn.Module):
    """fc1 -> GELU -> fc2 (GPT, BERT, ViT).

    Args:
        hidden: model width.
        ffn_hidden: inner width.
        approximate: GELU approximation ("tanh" for GPT-2's gelu_new, "none" for BERT/ViT).
    """

    def __init__(self, hidden: int, ffn_hidden: int, approximate: str = "none"):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) without biases (Shazeer 2020; Llama)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One transformer block: attention and MLP sub-layers with residuals.

    Args:
        attn: the attention module.
        mlp: the feed-forward module (dense or mixture of experts).
        make_norm: builds one normalisation module (called twice).
        pre_norm: normalise sub-layer inputs (GPT-2, Llama, ViT) or, if False, the residual
            sums (BERT's post-LN).
    """

    def __init__(self, attn: nn.Module, mlp: nn.Module, make_norm: Callable[[], nn.Module], *,
                 pre_norm: bool = True):
        super().__init__()
        self.attn_norm = make_norm()
        self.attn = attn
        self.mlp_norm = make_norm()
        self.mlp = mlp
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(x + self.attn(x))
        return self.mlp_norm(x + self.mlp(x))


class PositionalEmbedding(nn.Module):
    """Token embedding plus a learned position table (GPT-2/3, and the base of BERT's).

    Args:
        vocab: vocabulary size.
        hidden: model width.
        max_positions: rows of the position table; the traced sequence must not exceed it.

    Context parallelism sets `positions`, the positions of this rank's tokens (None: 0..s-1).
    """

    def __init__(self, vocab: int, hidden: int, max_positions: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_positions, hidden)
        self.positions: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        else:
            positions = self.positions.to(tokens.device)
        return self.tok(tokens) + self.pos(positions)


class LanguageModel(nn.Module):
    """Embedding, a stack of blocks, optional final norm, output head and loss.

    The top-level children are the pipeline-cut units in order: `embed`, `layers` (an
    nn.ModuleList of blocks), `norm` (absent for post-LN models), `head` and `loss`.

    Args:
        embed: maps token ids (b, s) to activations (b, s, hidden).
        layers: the transformer blocks.
        norm: final normalisation, or None.
        head: maps activations to logits (b, s, vocab).
    """

    def __init__(self, embed: nn.Module, layers: list[nn.Module], norm: nn.Module | None,
                 head: nn.Module):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.head = head
        self.loss = nn.CrossEntropyLoss()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Returns the mean cross entropy of the logits against the input tokens themselves.

        The targets are the unshifted inputs: a training step that reads separately shifted
        labels has the same shapes, FLOPs and memory. Logits are upcast to float32 for the loss,
        as Megatron-LM and torchtitan do.

        Args:
            tokens: LongTensor of shape (batch, seq_len).

        Returns:
            A scalar loss.
        """
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        logits = self.head(x)
        return self.loss(logits.flatten(0, 1).float(), tokens.flatten())
