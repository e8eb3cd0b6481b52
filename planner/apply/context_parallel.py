"""Context parallelism: each of the `cp` ranks of a group holds one contiguous chunk of every sequence.

Everything but attention is per token, so it runs on the local chunk unchanged; positions start at
the chunk's first token (`position_offset` of the zoo's embeddings and attention). Attention
all-gathers the keys and values of the whole sequence from the group and runs this rank's queries
against them, masked causally at their true positions: the all-gather form of context parallelism
that Llama 3's training used (Dubey et al. 2024, section 3.3.2). Its traffic is the ring's (every
rank receives every other chunk's keys and values), which the cost model prices as overlapped with
attention; here the gather runs before attention rather than beside it. The loss of each rank is
the mean over its chunk, so averaging gradients over the (dp, cp) ranks gives the full sequence's.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh

from planner.zoo.layers import Attention

# Dimension of the sequence in the (b, heads, s, head_dim) keys and values attention reads.
KV_SEQUENCE_DIM = 2


def apply_context_parallel(module: nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Makes `module` run this rank's chunk of `seq_len`-token sequences (see the module docstring)."""
    offset = cp_mesh.get_local_rank() * (seq_len // cp_mesh.size())
    for child in module.modules():
        if hasattr(child, "position_offset"):
            child.position_offset = offset
        if isinstance(child, Attention):
            child.attend = functools.partial(_attend_whole_sequence, child, cp_mesh, offset)


def _attend_whole_sequence(attention: Attention, mesh: DeviceMesh, offset: int, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor) -> torch.Tensor:
    """This rank's queries against the keys and values of the whole sequence, gathered from the group."""
    k = all_gather_tensor_autograd(k.contiguous(), KV_SEQUENCE_DIM, mesh.get_group())
    v = all_gather_tensor_autograd(v.contiguous(), KV_SEQUENCE_DIM, mesh.get_group())
    mask = None
    if attention.causal:
        query_positions = offset + torch.arange(q.shape[KV_SEQUENCE_DIM], device=q.device)
        mask = torch.arange(k.shape[KV_SEQUENCE_DIM], device=q.device) <= query_positions[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=attention.kv_heads != attention.heads)
