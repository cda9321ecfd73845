"""AutoAWQ "gemm" checkpoints: 4-bit packing, the torch reference dequantization, the config.

For a linear with in_features K and out_features N (HF weight [N, K]) and group size G:

    qweight  int32   [K, N/8]    8 output columns per int32, AWQ's interleaved nibble order
    qzeros   int32   [K/G, N/8]  packed like qweight
    scales   float16 [K/G, N]

    Wᵀ[k, n] = (q[k, n] - z[k // G, n]) * scales[k // G, n]          y = x Wᵀ + b

Nibble i (bits 4i..4i+3) of packed column c holds output column 8c + AWQ_ORDER[i]:

    int32 bits:   [31..28][27..24][23..20][19..16][15..12][11..8][7..4][3..0]
    nibble i:         7       6       5       4       3      2     1     0
    column 8c +:      7       3       6       2       5      1     4     0
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]
PACK = 8  # 4-bit values per int32
_CONFIG_FILES = ("quant_config.json", "quantize_config.json")


# ------------------------------------------------------------------ packing
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [R, N] integers in 0..15 -> int32 [R, N/8] in AWQ's interleaved order."""
    rows, cols = codes.shape
    if cols % PACK:
        raise ValueError(f"AWQ packs 8 columns per int32: {cols} columns is not a multiple of 8")
    codes = codes.to(torch.int64)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("4-bit codes must lie in 0..15")
    grouped = codes.view(rows, cols // PACK, PACK)
    packed = torch.zeros(rows, cols // PACK, dtype=torch.int64, device=codes.device)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= grouped[:, :, column] << (4 * nibble)
    # Bits 28..31 set means a negative int32: wrap from the unsigned 32-bit value.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] -> int32 codes [R, N] in 0..15 (the inverse of `pack_int4`)."""
    shifts = torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int32, device=packed.device) * 4
    # Mask after the shift: nibble 7 of a negative int32 sign-extends.
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [R, N/8, 8]
    return codes.reshape(packed.shape[0], packed.shape[1] * PACK)


def dequantize(
    qweight: torch.Tensor,  # int32 [K, N/8]
    qzeros: torch.Tensor,  # int32 [K/G, N/8]
    scales: torch.Tensor,  # [K/G, N]
    group_size: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The torch reference: Wᵀ [K, N] = (q - z) * s, computed in float32, cast to `dtype`."""
    q = unpack_int4(qweight).to(torch.float32)
    z = unpack_int4(qzeros).to(torch.float32)
    s = scales.to(torch.float32)
    if q.shape[0] != z.shape[0] * group_size or s.shape != z.shape:
        raise ValueError(
            f"inconsistent AWQ tensors: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group size {group_size}"
        )
    w = (q - z.repeat_interleave(group_size, 0)) * s.repeat_interleave(group_size, 0)
    return w.to(dtype or scales.dtype)


# --------------------------------------------------------------- quantizing
@dataclass(slots=True)
class QuantizedWeight:
    """Group-wise asymmetric INT4 codes of one HF weight [N, K] (natural layout)."""

    codes: torch.Tensor  # int32 [N, K], 0..15
    zeros: torch.Tensor  # int32 [N, K/G], 0..15
    scales: torch.Tensor  # float16 [N, K/G]

    def dequantize(self) -> torch.Tensor:
        """-> float32 [N, K], exactly what a loader computes from the packed tensors."""
        group_size = self.codes.shape[1] // self.zeros.shape[1]
        z = self.zeros.repeat_interleave(group_size, 1).float()
        s = self.scales.float().repeat_interleave(group_size, 1)
        return (self.codes.float() - z) * s

    def pack(self) -> dict[str, torch.Tensor]:
        """-> {qweight [K, N/8], qzeros [K/G, N/8], scales fp16 [K/G, N]} (AutoAWQ gemm)."""
        return {
            "qweight": pack_int4(self.codes.t().contiguous()),
            "qzeros": pack_int4(self.zeros.t().contiguous()),
            "scales": self.scales.t().contiguous(),
        }


def quantize_weight(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Min-max asymmetric INT4 per (output row, group of `group_size` inputs).

    weight [N, K]. The scale is rounded to float16 *before* the codes are chosen, so the
    codes are the best ones for the scale a loader will actually read.
    """
    rows, cols = weight.shape
    if group_size <= 0 or cols % group_size:
        raise ValueError(
            f"group size {group_size} must divide in_features {cols}; choose a group size "
            "that divides every linear's input size (e.g. 64 when hidden_size is 576)"
        )
    w = weight.detach().to(torch.float32).reshape(-1, group_size)
    w_max = w.amax(dim=1, keepdim=True)
    w_min = w.amin(dim=1, keepdim=True)
    scales = ((w_max - w_min).clamp(min=1e-5) / 15).to(torch.float16).to(torch.float32)
    zeros = (-torch.round(w_min / scales)).clamp(0, 15)
    codes = (torch.round(w / scales) + zeros).clamp(0, 15)
    groups = cols // group_size
    return QuantizedWeight(
        codes=codes.to(torch.int32).reshape(rows, cols),
        zeros=zeros.to(torch.int32).reshape(rows, groups),
        scales=scales.to(torch.float16).reshape(rows, groups),
    )


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """weight [N, K] -> Q(weight) [N, K] in weight's dtype (quantize, then dequantize)."""
    return quantize_weight(weight, group_size).dequantize().to(weight.dtype)


# ------------------------------------------------------------------- config
@dataclass(slots=True)
class AWQConfig:
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: list[str] = field(default_factory=list)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `quantization_config` AutoAWQ writes into config.json."""
        return {
            "quant_method": "awq",
            "bits": self.bits,
            "group_size": self.group_size,
            "zero_point": self.zero_point,
            "version": self.version,
            "modules_to_not_convert": list(self.modules_to_not_convert) or None,
        }

    def group_size_for(self, in_features: int) -> int:
        """G = -1 means one group over the whole input."""
        return in_features if self.group_size == -1 else self.group_size


def parse_awq_config(raw: dict[str, Any]) -> AWQConfig:
    """Read a quantization_config (AutoAWQ, transformers or vLLM spelling) and check it."""
    method = str(raw.get("quant_method", "awq")).lower()
    if method != "awq":
        raise ValueError(f"not an AWQ config: quant_method is {method!r}")
    bits = int(raw.get("bits", raw.get("w_bit", 4)))
    group_size = int(raw.get("group_size", raw.get("q_group_size", 128)))
    zero_point = bool(raw.get("zero_point", True))
    version = str(raw.get("version", "gemm")).lower()
    skip = list(raw.get("modules_to_not_convert") or [])
    if bits != 4:
        raise ValueError(f"pagedllm runs 4-bit AWQ only; this checkpoint has bits={bits}")
    if version != "gemm":
        raise ValueError(
            f"AWQ version {version!r} is not supported (pagedllm reads 'gemm' checkpoints); "
            "re-quantize with `pagedllm quantize` or AutoAWQ's default version='gemm'"
        )
    if not zero_point:
        raise ValueError("AWQ gemm checkpoints carry zero points; zero_point=false is unsupported")
    if group_size != -1 and (group_size <= 0 or group_size % PACK):
        raise ValueError(f"AWQ group size must be -1 or a positive multiple of 8, got {group_size}")
    return AWQConfig(bits, group_size, zero_point, version, skip)


def load_awq_config(folder: Path) -> AWQConfig | None:
    """config.json's quantization_config, else quant_config.json / quantize_config.json."""
    config = folder / "config.json"
    if config.exists():
        raw = json.loads(config.read_text()).get("quantization_config")
        if raw and str(raw.get("quant_method", "")).lower() == "awq":
            return parse_awq_config(raw)
    for name in _CONFIG_FILES:
        path = folder / name
        if path.exists():
            raw = json.loads(path.read_text())
            if "quant_method" not in raw:
                raw = {**raw, "quant_method": "awq"}
            return parse_awq_config(raw)
    return None


def is_excluded(name: str, modules_to_not_convert: list[str] | None) -> bool:
    """AutoAWQ's rule: skip a linear if any listed string is a substring of its name."""
    return any(key in name for key in modules_to_not_convert or [])
