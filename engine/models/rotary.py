"""Rotary position embeddings: default, linear, dynamic (NTK), llama3 and longrope
scaling; full or partial (a share of each head); the CPU fast path's fused kernel.

The numerics follow Hugging Face transformers (inverse frequencies in float32, cos/sin cast
to the activation dtype) so that greedy outputs match it token for token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _fused_ops():
    return torch.ops.pagedllm


def rope_inv_freq(
    head_dim: int, rope_theta: float, scaling: dict[str, Any] | None, max_model_len: int
) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32) of a rope config; `head_dim` is the rotated
    part of a head (all of it unless the family rotates only a share).

    Supported `rope_type`s: default, linear, dynamic (NTK), llama3, longrope (alias su).
    `dynamic` is computed once for `max_model_len` (as vLLM does): identical to transformers
    while sequences stay within the original context, consistent across positions beyond it.
    `longrope` (Phi-3, Phi-4-mini) picks its short factors when max_model_len fits in the
    original context and its long ones otherwise, for every position: transformers switches
    a sequence to the long factors once it outgrows the original context (and recomputes it
    then); a paged cache cannot re-rotate what it holds, so one choice per engine it is.
    """
    base = float(rope_theta)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "dynamic" and scaling is not None:
        factor = float(scaling["factor"])
        original = int(scaling.get("original_max_position_embeddings") or max_model_len)
        if max_model_len > original:
            base = base * ((factor * max_model_len / original) - (factor - 1)) ** (
                head_dim / (head_dim - 2)
            )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    if rope_type in ("longrope", "su") and scaling is not None:
        original = int(scaling["original_max_position_embeddings"])
        chosen = scaling["long_factor"] if max_model_len > original else scaling["short_factor"]
        ext = torch.tensor(chosen, dtype=torch.float32)
        if ext.shape[0] != head_dim // 2:
            raise ValueError(
                f"longrope factors have {ext.shape[0]} entries, the rotary dim needs {head_dim // 2}"
            )
        return 1.0 / (ext * base**exponents)
    inv_freq = 1.0 / (base**exponents)
    if rope_type in ("default", "dynamic"):
        pass
    elif rope_type == "linear" and scaling is not None:
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3" and scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    else:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported "
            "(default, linear, dynamic, llama3, longrope)"
        )
    return inv_freq


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1, except for longrope, whose scaled context
    sharpens attention by sqrt(1 + ln(factor) / ln(original context))."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling is None or rope_type not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling.get("factor") or 1.0)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's rope: long wavelengths divided by `factor`, short ones kept, a ramp between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original / low
    high_freq_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half), cos/sin cached for every position.

    With rotary_dim < head_dim (partial rotary, Phi-4-mini) only the first rotary_dim
    features of each head turn; the rest pass through.
    """

    # Module path: buffers [max positions, rotary_dim] in the model's dtype. The fused
    # kernel reads only the first half of each row (the two halves are equal), so with
    # `fused` only those halves are kept, in float32 (`half_tables`): a 40,960-position
    # table (Qwen3's context) costs 21 MiB instead of 63.
    cos: torch.Tensor | None
    sin: torch.Tensor | None

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope_theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: int | None = None,
        fused: bool = False,
    ):
        super().__init__()
        self.fused = fused  # the C++ kernel (backend.fused_kernels), fixed at construction
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.dtype = dtype
        inv_freq = rope_inv_freq(self.rotary_dim, rope_theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, rotary_dim/2]
        factor = rope_attention_factor(scaling)
        # The rows' values in the model's dtype, whichever form holds them.
        half_cos = (freqs.cos() * factor).to(dtype)
        half_sin = (freqs.sin() * factor).to(dtype)
        # The fused kernel reads cos/sin [P, rotary_dim/2] float32.
        self._half_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        if fused:
            self._half_tables = (half_cos.float().to(device), half_sin.float().to(device))
            cos = sin = None
        else:
            cos = torch.cat((half_cos, half_cos), dim=-1).to(device)  # [P, rotary_dim]
            sin = torch.cat((half_sin, half_sin), dim=-1).to(device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # Every layer of one forward pass gets the same positions tensor: look its cos/sin
        # rows up once per pass, not once per layer.
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def half_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, rotary_dim / 2] float32, what the fused kernel reads (the two halves
        of each cached row are equal); the first rotary_dim features of a head turn."""
        if self._half_tables is None:
            assert self.cos is not None and self.sin is not None
            half = self.rotary_dim // 2
            self._half_tables = (
                self.cos[:, :half].float().contiguous(),
                self.sin[:, :half].float().contiguous(),
            )
        return self._half_tables

    def table_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows [n, rotary_dim] in the model's dtype, whichever form is kept."""
        if self.cos is not None and self.sin is not None:
            return self.cos[rows], self.sin[rows]
        cos, sin = (half[rows].to(self.dtype) for half in self.half_tables())
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D] -> rotated q, k (in place when fused)."""
        if self.fused:
            _fused_ops().rotary_neox_(q, k, positions, *self.half_tables())
            return q, k
        assert self.cos is not None and self.sin is not None  # kept unless fused
        if positions is not self._positions or self._cos_sin is None:
            self._cos_sin = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
            self._positions = positions
        cos, sin = self._cos_sin  # [T, 1, rotary_dim] each
        if self.rotary_dim == self.head_dim:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return _rotate_part(q, cos, sin, self.rotary_dim), _rotate_part(
            k, cos, sin, self.rotary_dim
        )


def _rotate_part(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    turned, kept = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
