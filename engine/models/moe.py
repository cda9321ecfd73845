"""A sparse mixture-of-experts MLP (Qwen3-MoE; shared by later MoE families).

    x [T, H] -> router logits [T, E] -> softmax (float32) -> top-k experts and weights per
    token (renormalized over the k when norm_topk_prob) -> each expert's gated MLP over the
    tokens routed to it -> weighted sum back per token.

Grouped execution: the T*k (token, expert) pairs are sorted by expert, so each expert's
tokens are one contiguous slice and each expert runs one matmul per linear over its slice;
experts no token chose cost nothing. Each expert is an ordinary `GatedMLP` made through the
LinearFactory, so AWQ and tensor-parallel linears (and, later, packed GGUF ones) plug in
as they do for dense layers. The router stays a plain replicated float matrix: it is never
quantized, and every tensor-parallel rank must route identically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import GatedMLP, LinearFactory, _fused_ops


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        act: str,
        prefix: str,  # checkpoint module, e.g. model.layers.3.mlp
        make_linear: LinearFactory,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts {num_experts}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.fused = fused  # the C++ kernels (backend.fused_kernels), fixed at construction
        # `gate` is the router's checkpoint name: [E, H]
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = nn.ModuleList(
            GatedMLP(
                hidden_size,
                intermediate_size,
                False,
                act,
                f"{prefix}.experts.{e}",
                make_linear,
                dtype,
                device,
                fused,
            )
            for e in range(num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k] int64).

        With the C++ kernels (`fused`) the logits come from `router_logits`, whose every
        element has one order of additions: torch's float32 matmul picks its blocking by
        T, so a token's logits, and from them its expert weights, changed in their last
        bits with the tokens that shared its step (a token's greedy output then depended
        on its batch). The whole-step C++ stack routes with the same op."""
        if self.fused and x.dtype == torch.float32:
            logits = _fused_ops().router_logits(x, self.gate.weight)
        else:
            logits = F.linear(x, self.gate.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = self.route(x)
        flat = experts.reshape(-1)  # [T*k] expert of each (token, slot) pair
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
        token_of = order // self.top_k  # [T*k] token of each grouped pair
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x.index_select(0, token_of)  # [T*k, H], expert e's tokens contiguous
        out = torch.empty_like(grouped)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                out[start : start + count] = expert(grouped[start : start + count])
                start += count
        out *= weights.reshape(-1)[order].unsqueeze(1)
        # Each token's k contributions are added in ascending expert order.
        return torch.zeros_like(x).index_add_(0, token_of, out)
