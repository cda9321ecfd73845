"""The two searches of AWQ (Lin et al., 2024), on plain tensors and nn.Linear modules.

1. Per-input-channel scales s (one group of linears that read the same input x):

       minimise  ‖ f(Q(W·diag(s)) · diag(s)⁻¹ x) − f(W x) ‖²      s = s_x^α  (or duo: s_x^α / s_w^(1−α))

   over α on a grid, where f is the block that contains the linears (attention, MLP, or the
   linear itself) and s_x the mean |x| per channel. diag(s)⁻¹ is later folded into the op
   that produces x (an RMSNorm, or the previous linear's output rows).

2. Per (output row, group) clipping: max|w| shrunk by 1, 0.95, ..., picked to minimise the
   error of the group's partial dot products on sampled inputs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .awq_format import fake_quantize

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScaleSearchResult:
    scales: torch.Tensor  # float32 [K]
    ratio: float  # the chosen α; -1.0 when no scaling (s = 1) won
    loss: float
    loss_unscaled: float  # plain round-to-nearest loss, for the log


def weight_channel_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of |w| normalised by its group's max: s_w [K]."""
    w = torch.cat([x.detach().float() for x in weights], dim=0)
    rows, cols = w.shape
    grouped = w.abs().view(-1, group_size)
    grouped = grouped / grouped.amax(dim=1, keepdim=True).clamp(min=1e-8)
    return grouped.view(rows, cols).mean(0)


@torch.no_grad()
def search_scales(
    linears: list[nn.Linear],
    quantize_mask: list[bool],
    x: torch.Tensor,  # [..., K] the input the linears read
    block: Callable[[torch.Tensor], torch.Tensor],  # x -> the block output to preserve
    group_size: int,
    n_grid: int = 20,
    duo_scaling: bool = True,
) -> ScaleSearchResult:
    """Grid search of the per-channel scale; the linears are left as they were."""
    originals = [lin.weight.data.clone() for lin in linears]
    x_mean = x.detach().abs().reshape(-1, x.shape[-1]).float().mean(0)
    w_mean = weight_channel_mean(originals, group_size) if duo_scaling else None
    reference = block(x).float()

    def loss_with(scales: torch.Tensor | None) -> float:
        for lin, weight, quantize in zip(linears, originals, quantize_mask):
            if not quantize:
                continue
            if scales is None:
                lin.weight.data = fake_quantize(weight, group_size)
            else:
                scaled = (weight.float() * scales[None, :]).to(weight.dtype)
                lin.weight.data = fake_quantize(scaled, group_size) / scales[None, :].to(
                    weight.dtype
                )
        return float((block(x).float() - reference).pow(2).mean())

    try:
        unscaled = loss_with(None)
        best = ScaleSearchResult(torch.ones_like(x_mean), -1.0, unscaled, unscaled)
        for step in range(n_grid):
            ratio = step / n_grid
            if w_mean is not None:
                scales = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)
            else:
                scales = x_mean.pow(ratio)
            scales = scales.clamp(min=1e-4)
            scales = scales / math.sqrt(float(scales.max() * scales.min()))
            loss = loss_with(scales)
            if loss < best.loss:
                best = ScaleSearchResult(scales, ratio, loss, unscaled)
    finally:
        for lin, weight in zip(linears, originals):
            lin.weight.data = weight
    return best


@torch.no_grad()
def apply_scales(prev: nn.Module, linears: list[nn.Linear], scales: torch.Tensor) -> None:
    """Fold diag(s)⁻¹ into `prev` (an RMSNorm or a Linear) and diag(s) into the linears.

    The product stays the same in exact arithmetic: W·diag(s) · diag(s)⁻¹·x = W·x.
    """
    if isinstance(prev, nn.Linear):  # its output rows are the next input's channels
        prev.weight.data = (prev.weight.data.float() / scales[:, None]).to(prev.weight.dtype)
        if prev.bias is not None:
            prev.bias.data = (prev.bias.data.float() / scales).to(prev.bias.dtype)
    elif isinstance(weight := getattr(prev, "weight", None), torch.Tensor) and weight.dim() == 1:
        weight.data = (weight.data.float() / scales).to(weight.dtype)  # RMSNorm: w * norm(x)
    else:
        raise ValueError(f"cannot fold AWQ scales into a {type(prev).__name__}")
    for lin in linears:
        lin.weight.data = (lin.weight.data.float() * scales[None, :]).to(lin.weight.dtype)


@torch.no_grad()
def search_clip(
    weight: torch.Tensor,  # [N, K]
    x: torch.Tensor,  # [T, K] sampled inputs
    group_size: int,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    rows_per_chunk: int = 1024,
) -> torch.Tensor:
    """Best max|w| per (row, group): float32 [N, K/G].

    The partial products of group g are one batched matmul:
    x[:, g] [T, G] @ w[:, g]ᵀ [G, N] for every g at once -> [K/G, T, N].
    """
    rows, cols = weight.shape
    groups = cols // group_size
    xg = x.float().reshape(-1, groups, group_size).permute(1, 0, 2)  # [ng, T, G]
    best_max = torch.empty(rows, groups, dtype=torch.float32, device=weight.device)
    for r0 in range(0, rows, rows_per_chunk):
        w = weight[r0 : r0 + rows_per_chunk].float()
        n = w.shape[0]
        wg = w.view(n, groups, group_size)
        org = torch.bmm(xg, wg.permute(1, 2, 0))  # [ng, T, n]
        max_abs = wg.abs().amax(dim=-1)  # [n, ng]
        best_err = torch.full_like(max_abs, float("inf"))
        chosen = max_abs.clone()
        for step in range(int(max_shrink * n_grid)):
            limit = max_abs * (1 - step / n_grid)
            clipped = torch.maximum(torch.minimum(wg, limit[..., None]), -limit[..., None])
            q = fake_quantize(clipped.reshape(n, cols), group_size).view(n, groups, group_size)
            out = torch.bmm(xg, q.permute(1, 2, 0))
            err = (out - org).pow(2).mean(dim=1).t()  # [n, ng]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            chosen = torch.where(better, limit, chosen)
        best_max[r0 : r0 + n] = chosen
    return best_max


@torch.no_grad()
def apply_clip(linear: nn.Linear, max_val: torch.Tensor, group_size: int) -> None:
    """Clamp each (row, group) of the weight to ±max_val [N, K/G]."""
    w = linear.weight.data
    rows, cols = w.shape
    wg = w.float().view(rows, cols // group_size, group_size)
    limit = max_val[..., None]
    clipped = torch.maximum(torch.minimum(wg, limit), -limit)
    linear.weight.data = clipped.view(rows, cols).to(w.dtype)


def sample_tokens(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """[..., K] -> [≤max_tokens, K], evenly spaced over all tokens."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= max_tokens:
        return flat
    step = flat.shape[0] // max_tokens
    return flat[::step][:max_tokens]
