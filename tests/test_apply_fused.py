"""Plan.apply's tensor parallelism on user blocks it cannot split as written: refused in one line, before
any process-group work, with the reason `paraplan plan` notes.

A fused input projection (GPT-2's q, k and v in one Linear, a gate and an up projection in one) split
by columns hands each rank contiguous slices: rank 0 of 2 held q heads 0-1 and q heads 2-3 as its q
and k, and trained another model without an error. Attention with separate q, k and v projections,
grouped-query key/value heads included, is still split.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

import planner
from planner.apply import apply_note, check_applicable
from planner.errors import PlannerError

HIDDEN, HEADS, VOCAB, SEQ_LEN = 64, 4, 256, 32
HEAD_DIM = HIDDEN // HEADS


class FusedQkvAttention(nn.Module):
    """nanoGPT's attention: one Linear for q, k and v, viewed as (3, heads, head_dim)."""

    def __init__(self):
        super().__init__()
        self.n_heads, self.head_dim = HEADS, HEAD_DIM
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, self.head_dim).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class GroupedQueryAttention(nn.Module):
    """Separate q, k and v projections with 2 key/value heads for the 4 query heads."""

    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, 2, HEAD_DIM
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, self.n_kv_heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, self.n_kv_heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        k, v = (proj(x).view(b, s, self.n_kv_heads, -1).transpose(1, 2).repeat_interleave(
            self.n_heads // self.n_kv_heads, dim=1) for proj in (self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class FusedGateUpMLP(nn.Module):
    """SwiGLU with the gate and up projections in one Linear, chunked in two."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * 4 * HIDDEN, bias=False)
        self.down_proj = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, attn: type[nn.Module], mlp: type[nn.Module]):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(HIDDEN), attn(), nn.LayerNorm(HIDDEN), mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class InlineMLPBlock(nn.Module):
    """A block holding its MLP's fc1 and fc2 itself, not in an MLP child."""

    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(HIDDEN), GroupedQueryAttention(), nn.LayerNorm(HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    """Embedding, 2 blocks, final norm and head: returns logits."""

    def __init__(self, block):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class EncoderLM(nn.Module):
    """torch's nn.TransformerEncoder: linear1 and linear2 sit in the layer beside its nn.MultiheadAttention."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 4 * HIDDEN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def _tp2(model: nn.Module) -> planner.Plan:
    return planner.plan(model, "cpu:1x2", global_batch=8, seq_len=SEQ_LEN, dtype="fp32", tp=2, pp=1)


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


@pytest.mark.parametrize("model, message", [
    (lambda: LM(lambda: Block(FusedQkvAttention, GeluMLP)),
     r"layout blocks\.0\.attn\.qkv: a fused projection \(192 outputs for o_proj's 64 inputs\) holds q, k and v side by "
     r"side, which a column split would cut across heads; split it into separate q, k, v Linears, or plan with --tp 1$"),
    (lambda: LM(lambda: Block(GroupedQueryAttention, FusedGateUpMLP)),
     r"layout blocks\.0\.mlp\.gate_up_proj: a fused projection \(512 outputs for down_proj's 256 inputs\) holds a gate "
     r"and an up projection side by side, .*split it into separate gate and up Linears, or plan with --tp 1$"),
    (lambda: LM(InlineMLPBlock),
     r"layout blocks\.0\.fc1: Plan\.apply splits a block's Linears only inside its attention, MLP or mixture-of-experts "
     r"child .*o_proj, fc2, down_proj\), and this Linear sits directly in block blocks\.0; move it into such a child"),
    # The plan leaves self_attn whole: the reason is the split linear1 beside it.
    (EncoderLM, r"layout encoder\.layers\.0\.linear1: Plan\.apply splits a block's Linears only inside"),
], ids=["fused_qkv", "fused_gate_up", "mlp_linears_in_the_block", "torch_encoder_layer"])
def test_a_tensor_parallel_plan_of_a_block_it_cannot_split_is_refused_with_the_reason(monkeypatch, model, message):
    planned = _tp2(model())
    assert re.search(message, apply_note(planned, model()))  # what `paraplan plan` notes
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlannerError, match=message):
        planned.apply(model(), loss_fn=_loss)
    assert not dist.is_initialized()


def test_separate_grouped_query_projections_are_still_split():
    # k_proj and v_proj are narrower than o_proj's input (2 key/value heads for 4 query heads): not fused.
    model = LM(lambda: Block(GroupedQueryAttention, GeluMLP))
    planned = _tp2(model)
    assert planned.layouts["blocks.0.attn.k_proj"] == "colwise" and planned.layouts["blocks.0.attn"] == "heads"
    assert apply_note(planned, model) == ""
    _, tp_plan = check_applicable(planned, model)
    assert all(isinstance(tp_plan.styles[f"blocks.0.attn.{name}"], ColwiseParallel) for name in ("q_proj", "k_proj", "v_proj"))
