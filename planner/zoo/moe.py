"""Mixture-of-experts decoders (Mixtral, DeepSeek-MoE): the Llama skeleton with routed experts.

The MoE feed-forward routes with static shapes, so it traces with torch.fx, runs on meta and
fake tensors, and FlopCounterMode sees exactly the expert work of `tokens * top_k` token-expert
pairs: GShard-style capacity dispatch (Lepikhin et al. 2021) with capacity factor 1, i.e.
`capacity = ceil(tokens * top_k / experts)` slots per expert, one batched matmul over the
stacked expert weights, and token-expert pairs past an expert's capacity dropped (their slot is
a spare row that is never computed). Tokens move as fused permute kernels move them (Megatron-Core's
`--moe-permute-fusion`, torchtitan's index gather): one gather into the slots and one gather back,
weighted and summed, each token-expert pair once each way. Expert weights live under a submodule
named `experts`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.zoo.layers import INIT_STD, LanguageModel, SwiGLU
from planner.zoo.llama import build_rope_decoder
from planner.zoo.spec import ModelSpec


class GroupedLinear(nn.Module):
    """One linear map per expert, weights stacked on dim 0 (the dim expert parallelism shards):
    (experts, tokens, in_features) @ weight (experts, in_features, out_features).

    Tensor parallelism splits it as a Linear: by `out_features` (colwise) or `in_features` (rowwise).
    """

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, in_features, out_features))
        nn.init.normal_(self.weight, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.weight)


class Experts(nn.Module):
    """`experts` SwiGLU MLPs, each projection a `GroupedLinear` over all experts.

    Args:
        experts: number of experts.
        hidden: model width.
        ffn_hidden: inner width of one expert.
    """

    def __init__(self, experts: int, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate_proj = GroupedLinear(experts, hidden, ffn_hidden)
        self.up_proj = GroupedLinear(experts, hidden, ffn_hidden)
        self.down_proj = GroupedLinear(experts, ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(experts, capacity, hidden) -> (experts, capacity, hidden)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    """Top-k routed experts plus optional always-on shared experts.

    Router probabilities are a softmax over all experts; the top-k are renormalised to sum to 1
    (equivalent to Mixtral's softmax over the top-k logits). Slots are filled in priority order
    first choices of all tokens, then second choices, and so on (GShard).

    Args:
        hidden: model width.
        experts: routed experts.
        top_k: experts per token.
        ffn_hidden: inner width of one expert.
        shared_experts: always-on experts, fused into one SwiGLU of width
            `shared_experts * ffn_hidden` (DeepSeek-MoE); 0 for none.
    """

    def __init__(self, hidden: int, experts: int, top_k: int, ffn_hidden: int,
                 shared_experts: int = 0):
        super().__init__()
        self.num_experts = experts
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn_hidden)
        self.shared = SwiGLU(hidden, shared_experts * ffn_hidden) if shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)
        num_tokens, hidden = tokens.shape[0], tokens.shape[1]
        weights, chosen = self.router(tokens).softmax(dim=-1).topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).t().flatten()
        chosen = chosen.t().flatten()
        capacity = (num_tokens * self.top_k + self.num_experts - 1) // self.num_experts
        spare_slot = self.num_experts * capacity
        is_choice = chosen.unsqueeze(1) == torch.arange(self.num_experts, device=x.device)
        queue_pos = (is_choice.cumsum(dim=0) * is_choice).sum(dim=1) - 1
        slot = torch.where(queue_pos < capacity, chosen * capacity + queue_pos, spare_slot)
        # The token each slot holds: pairs write their slots (only dropped pairs share one, the spare,
        # cut off); an empty slot reads token 0, whose expert output no pair gathers back.
        pair_token = torch.arange(num_tokens * self.top_k, device=x.device) % num_tokens
        slot_token = slot.new_zeros(spare_slot + 1).scatter(0, slot, pair_token)[:-1]
        expert_out = self.experts(tokens[slot_token].unflatten(0, (self.num_experts, capacity)))
        kept = slot < spare_slot
        gathered = expert_out.flatten(0, 1)[slot.clamp(max=spare_slot - 1)]
        routed = (gathered * (weights * kept).unsqueeze(1)).unflatten(0, (self.top_k, num_tokens)).sum(0)
        out = routed.view_as(x)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


def build_moe(spec: ModelSpec) -> LanguageModel:
    """Builds a Llama-style MoE decoder (Mixtral, Jiang et al. 2024; DeepSeek-MoE, Dai et al. 2024).

    The first `spec.dense_layers` blocks use a dense SwiGLU of width `spec.ffn_hidden`; the rest
    use MoEFeedForward.

    Args:
        spec: a spec with arch moe.

    Returns:
        A LanguageModel.
    """
    def make_mlp(index: int) -> nn.Module:
        if index < spec.dense_layers:
            return SwiGLU(spec.hidden, spec.ffn_hidden)
        return MoEFeedForward(spec.hidden, spec.experts, spec.top_k, spec.moe_ffn_hidden,
                              spec.shared_experts)

    return build_rope_decoder(spec, make_mlp)
