"""Context parallelism: the `cp` ranks of a group split every sequence between them.

Everything but attention is per token, so it runs on the local tokens unchanged, at their true
positions (`positions` of the zoo's embeddings and attention). Attention all-gathers the keys and
values of the whole sequence from the group and runs this rank's queries against them, masked
causally at their true positions: the all-gather form of context parallelism that Llama 3's training
used (Dubey et al. 2024, section 3.3.2). As there, the sequence is cut into 2·cp chunks and rank r
holds chunks r and 2·cp-1-r, so that under the causal mask every rank computes the same share of
the attention scores (with one contiguous chunk each, the last rank would compute 2·cp-1 times the
first's), as the cost model prices it. Each chunk's queries run against only the keys up to the
chunk's end (in sequence order), so a rank computes (2·cp+1)/(2·cp) of its causal share of the
scores (the masked half of the diagonal blocks) rather than twice it. The traffic is the ring's
(every rank receives every other rank's keys and values), which the cost model prices as
overlapped with attention; here the gather runs before attention rather than beside it. Each rank's loss is the mean over its tokens, so
averaging gradients over the (dp, cp) ranks gives the whole sequence's.

With the plan's training code at `cp_comm: a2a` (DeepSpeed-Ulysses, `planner.layer_comm.CpComm`)
attention instead exchanges heads for tokens: an all-to-all sends each rank's tokens of head block
j to rank j, which then holds 1/cp of the heads over the whole sequence, runs ordinary (causal)
attention on them, and a second all-to-all returns each rank its tokens of every head. Keys and
values travel the same way (grouped-query heads in the blocks of their queries).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from planner.errors import invalid
from planner.layer_comm import CpComm
from planner.zoo.layers import Attention

# Dimension of the sequence in the (b, heads, s, head_dim) queries, keys and values attention reads.
SEQUENCE_DIM = 2


def token_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of the tokens `rank` holds: chunks `rank` and `2·cp-1-rank` of 2·cp equal chunks."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def apply_context_parallel(module: nn.Module, cp_mesh: DeviceMesh, seq_len: int, cp_comm: CpComm = CpComm.ALL_GATHER) -> None:
    """Makes `module` run this rank's tokens of `seq_len`-token sequences, exchanging attention's
    inputs as `cp_comm` says (see the module docstring)."""
    cp = cp_mesh.size()
    positions = token_positions(seq_len, cp, cp_mesh.get_local_rank())
    gathered = torch.cat([token_positions(seq_len, cp, rank) for rank in range(cp)])
    order = torch.argsort(gathered)
    chunk = seq_len // (2 * cp)
    # Per local chunk: its queries' slice, and the causal mask of those queries over the keys up to its end.
    chunks = []
    for first in range(0, 2 * chunk, chunk):
        queries = positions[first:first + chunk]
        end = int(queries[-1]) + 1
        chunks.append((slice(first, first + chunk), end, torch.arange(end)[None, :] <= queries[:, None]))
    for child in module.modules():
        if hasattr(child, "positions"):
            child.positions = positions
        if isinstance(child, Attention) and cp_comm is CpComm.ALL_TO_ALL:
            child.attend = functools.partial(_attend_head_shards, child, cp_mesh, order, torch.argsort(order))
        elif isinstance(child, Attention):
            child.attend = functools.partial(_attend_whole_sequence, child, cp_mesh, order, chunks)


def _attend_whole_sequence(attention: Attention, mesh: DeviceMesh, order: torch.Tensor, chunks: list,
                           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """This rank's queries against the keys and values of the whole sequence, gathered from the group
    (in rank order; `order` puts them in sequence order), each chunk of queries against the keys up
    to its end."""
    k = all_gather_single_autograd(k.contiguous(), SEQUENCE_DIM, mesh.get_group())
    v = all_gather_single_autograd(v.contiguous(), SEQUENCE_DIM, mesh.get_group())
    gqa = attention.kv_heads != attention.heads
    if not attention.causal:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    order = order.to(k.device)
    k, v = k.index_select(SEQUENCE_DIM, order), v.index_select(SEQUENCE_DIM, order)
    return torch.cat([F.scaled_dot_product_attention(q[:, :, queries], k[:, :, :end], v[:, :, :end],
                                                     attn_mask=mask.to(q.device), enable_gqa=gqa)
                      for queries, end, mask in chunks], dim=SEQUENCE_DIM)


def _attend_head_shards(attention: Attention, mesh: DeviceMesh, order: torch.Tensor, inverse: torch.Tensor,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention by head shards: this rank's 1/cp of the heads over the whole sequence, between two
    all-to-alls (`order` puts the gathered tokens in sequence order, `inverse` back in rank order)."""
    group, cp = mesh.get_group(), mesh.size()
    if q.shape[1] % cp or k.shape[1] % cp:
        raise invalid(f"cp_comm=a2a: this rank's {q.shape[1]} query and {k.shape[1]} key/value heads do not split over "
                      f"cp={cp}; the plan was made for a model with other heads, re-plan for this one")
    order, inverse = order.to(q.device), inverse.to(q.device)

    def heads_to_ranks(x: torch.Tensor) -> torch.Tensor:  # (b, n, s/cp, d) -> (b, n/cp, s, d)
        b, n, local, d = x.shape
        blocks = x.reshape(b, cp, n // cp, local, d).transpose(0, 1).contiguous()  # block j goes to rank j
        received = all_to_all_single_autograd(blocks, None, None, group)  # block i came from rank i
        return received.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * local, d).index_select(SEQUENCE_DIM, order)

    out = F.scaled_dot_product_attention(heads_to_ranks(q), heads_to_ranks(k), heads_to_ranks(v),
                                         is_causal=attention.causal, enable_gqa=attention.kv_heads != attention.heads)
    b, n, seq, d = out.shape
    blocks = out.index_select(SEQUENCE_DIM, inverse).reshape(b, n, cp, seq // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    received = all_to_all_single_autograd(blocks, None, None, group)  # rank j's tokens of head block j
    return received.transpose(0, 1).reshape(b, cp * n, seq // cp, d)
