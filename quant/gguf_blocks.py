"""GGUF (llama.cpp) quantized blocks -> the packed U4 / I8 formats, exactly.

Every row of a GGUF weight [N, K] is a run of blocks along K. Each type maps onto a
packed format with the values llama.cpp dequantizes it to (see quant/packed.py):

    type   block  bytes  per group                          -> format
    Q2_K    256     84   16 x 16: w = d*sc_j * q - dmin*m_j   I8 g16, scale d*sc_j, min -dmin*m_j
                         (q 0..3, sc_j, m_j 4-bit)
    Q3_K    256    110   16 x 16: w = d*(sc_j - 32) * q       I8 g16, scale d*(sc_j - 32)
                         (q -4..3, sc_j 6-bit)
    Q4_0     32     18   w = d * (q - 8),  q 0..15            U4, scale d, min -8d
    Q4_1     32     20   w = d * q + m                        U4, scale d, min m
    Q4_K    256    144   8 x 32: w = d*sc_j * q - dmin*m_j    U4, scale d*sc_j, min -dmin*m_j
    Q5_0     32     22   w = d * (q - 16), q 0..31            I8 g32, q - 16, scale d
    Q5_1     32     24   w = d * q + m                        I8 g32, scale d, min m
    Q5_K    256    176   8 x 32: w = d*sc_j * q - dmin*m_j    I8 g32, scale d*sc_j, min -dmin*m_j
    Q6_K    256    210   16 x 16: w = d*sc_j * (q - 32)       I8 g16, scale d*sc_j
    Q8_0     32     34   w = d * q, q int8                    I8 g32, scale d

d, m, dmin are fp16; sc_j, m_j are 4- or 6-bit integers (K-quants) or int8 (Q6_K): every
scale and min is exact in float32. These are every type llama-quantize writes for its Q2_K
to Q8_0 mixes (with their fallbacks for rows that are not whole 256-blocks). Every I8
type but Q8_0 has q in -32..31, and the kernels hold those in 6 bits a value (i6 tiles,
`PackedWeight.tile_kind`): a Q6_K tensor reads 6.6 bits a weight per token, not 8.6. Other types
(F16, the IQ and ternary types) are dequantized once to bf16 by the caller
(`dequantize_to`).
"""

from __future__ import annotations

import numpy as np
import torch

from .packed import U4_GROUP, KFactors, PackedWeight, pack_u4

QK_K = 256
PACKED_TYPES = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
_BLOCK = {  # type -> (elements per block, bytes per block)
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "Q8_0": (32, 34),
}


def to_packed(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """Raw blocks (uint8 [N, K / block * bytes]) of a GGUF tensor of logical `shape` (N, K)."""
    if type_name not in _BLOCK:
        raise ValueError(f"GGUF type {type_name} has no packed form; dequantize it instead")
    n, k = shape
    per_block, nbytes = _BLOCK[type_name]
    if k % per_block:
        raise ValueError(f"{type_name} rows of {k} values are not whole blocks of {per_block}")
    blocks = np.asarray(data, dtype=np.uint8).reshape(n * (k // per_block), nbytes)
    if type_name in ("Q4_0", "Q4_1"):
        return _u4_as_stored(type_name, np.ascontiguousarray(blocks), n, k)
    # Decoded a slice of rows at a time into the full weight's tensors: the decoders'
    # intermediates (int16 values, nibble planes, float products: several bytes per value)
    # then take tens of MB, not GBs (a 151,936-row Q6_K embedding held ~800 MB of them).
    rows = max(1, _CHUNK_VALUES // k)
    per_row = k // per_block
    whole: PackedWeight | None = None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        part = _decode_rows(
            type_name, np.ascontiguousarray(blocks[r0 * per_row : r1 * per_row]), r1 - r0, k
        )
        if whole is None:
            if r1 == n:
                return part
            whole = _empty_like_rows(part, n)
        _copy_rows(whole, part, r0)
    assert whole is not None
    return whole


_CHUNK_VALUES = 1 << 22  # values of K decoded at once


def _empty_like_rows(part: PackedWeight, n: int) -> PackedWeight:
    """A weight of n rows with part's formats, every tensor allocated, not filled."""

    def like(t: torch.Tensor) -> torch.Tensor:
        return t.new_empty((n, *t.shape[1:]))

    def factors(f: KFactors | None) -> KFactors | None:
        return None if f is None else KFactors(like(f.multipliers), like(f.factors))

    mins = None if part.mins is None else like(part.mins)
    return PackedWeight(
        part.kind, like(part.qweight), like(part.scales), mins, part.group, (n, part.shape[1]),
        factors(part.scale_factors), factors(part.min_factors),
    )  # fmt: skip


def _copy_rows(whole: PackedWeight, part: PackedWeight, r0: int) -> None:
    r1 = r0 + part.shape[0]
    pairs = [(whole.qweight, part.qweight), (whole.scales, part.scales), (whole.mins, part.mins)]
    for w, p in ((whole.scale_factors, part.scale_factors), (whole.min_factors, part.min_factors)):
        if w is not None and p is not None:
            pairs += [(w.multipliers, p.multipliers), (w.factors, p.factors)]
    for target, source in pairs:
        if target is not None and source is not None:
            target[r0:r1] = source


def _decode_rows(type_name: str, blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    q, scale, mins, group = _DECODERS[type_name](blocks)
    # q: [num_blocks, per_block] integer values; scale/mins: [num_blocks, per_block // group]
    # values, or a K-quant's two levels (factor per block, integer multiplier per group)
    q = q.reshape(n, k)
    scale_t, scale_factors = _values(scale, n, k, group)
    mins_t, min_factors = (None, None) if mins is None else _values(mins, n, k, group)
    if type_name in ("Q4_0", "Q4_1", "Q4_K"):
        assert group == U4_GROUP and mins_t is not None
        kind, q_t = "u4", pack_u4(torch.from_numpy(q))
    else:
        kind, q_t = "i8", torch.from_numpy(np.ascontiguousarray(q.astype(np.int8)))
    return PackedWeight(kind, q_t, scale_t, mins_t, group, (n, k), scale_factors, min_factors)


def _values(decoded, n: int, k: int, group: int) -> tuple[torch.Tensor, KFactors | None]:
    """(float32 [N, K/G] values, their K factors or None) of a decoder's scales or mins."""
    if not isinstance(decoded, tuple):
        values = np.ascontiguousarray(decoded, dtype=np.float32).reshape(n, k // group)
        return torch.from_numpy(values), None
    factor, multiplier = decoded  # [blocks] float32, [blocks, QK_K // group] integers
    factor = factor.astype(np.float32)
    products = factor[:, None] * multiplier.astype(np.float32)  # exact: fp16 x small int
    factors = KFactors(
        torch.from_numpy(np.ascontiguousarray(multiplier.astype(np.int8).reshape(n, k // group))),
        torch.from_numpy(np.ascontiguousarray(factor.reshape(n, k // QK_K))),
    )
    return torch.from_numpy(np.ascontiguousarray(products.reshape(n, k // group))), factors


def _u4_as_stored(type_name: str, blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    """Q4_0 / Q4_1: the 16 bytes of nibbles that end each block are already in the U4 order
    (byte j = q[j] | q[j + 16] << 4), so they are copied, not unpacked and packed again
    (which was most of a first load's time for the default model)."""
    qweight = torch.from_numpy(np.ascontiguousarray(blocks[:, -16:]).reshape(n, k // 2))
    d = _f16(blocks[:, 0:2])
    mins = -8.0 * d if type_name == "Q4_0" else _f16(blocks[:, 2:4])
    scale_t = torch.from_numpy(d.reshape(n, k // U4_GROUP))
    mins_t = torch.from_numpy(
        np.ascontiguousarray(mins, dtype=np.float32).reshape(n, k // U4_GROUP)
    )
    return PackedWeight("u4", qweight, scale_t, mins_t, U4_GROUP, (n, k))


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 stored in uint8 pairs [B, 2] -> float32 [B]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5 layout: 16 bytes -> 32 values, byte j = q[j] | q[j + 16] << 4."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    q = _nibbles_32(b[:, 2:18])
    return q, d[:, None], (-8.0 * d)[:, None], 32


def _q4_1(b: np.ndarray):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _nibbles_32(b[:, 4:20]), d[:, None], m[:, None], 32


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes = 32 bits, bit j is the fifth bit of value j."""
    bits = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    q = _nibbles_32(b[:, 6:22]) | (_high_bits_32(b[:, 2:6]) << 4)
    return q.astype(np.int16) - 16, d[:, None], None, 32


def _q5_1(b: np.ndarray):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles_32(b[:, 8:24]) | (_high_bits_32(b[:, 4:8]) << 4)
    return q, d[:, None], m[:, None], 32


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block, from its 12 bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the
    mins likewise, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 128 bytes -> 256 values: chunk c of 32 bytes holds sub-block 2c in its
    low nibbles and sub-block 2c + 1 in its high nibbles."""
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, QK_K)


def _q4_k(b: np.ndarray):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return _k_low_nibbles(b[:, 16:144]), (d, sc), (-dmin, mn), 32


def _q5_k(b: np.ndarray):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = (qh & 1).reshape(-1, QK_K)  # bit j of qh[l] is the fifth bit of sub-block j
    q = _k_low_nibbles(b[:, 48:176]) | (high << 4)
    return q, (d, sc), (-dmin, mn), 32


def _q6_k(b: np.ndarray):
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    d = _f16(b[:, 208:210])
    # Each half of 128 values: low nibbles of ql[0:32], ql[32:64], then high nibbles of
    # both; two high bits each from qh[0:32] at shifts 0, 2, 4, 6.
    nibbles = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (nibbles & 0x0F).reshape(-1, 2, 4, 32)
    pairs = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = pairs & 0x03
    q = (low | (high << 4)).reshape(-1, QK_K).astype(np.int16) - 32
    return q, (d, sc), None, 16


def _two_bit_values(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K: 64 bytes -> 256 two-bit values: byte 32i + l holds value 128i + 32s + l
    in bits 2s, 2s + 1 (s = 0..3)."""
    shifted = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (shifted & 0x03).reshape(-1, QK_K)


def _q2_k(b: np.ndarray):
    scales = b[:, 0:16]  # sub-block j: scale in the low nibble, min in the high one
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    sc, mn = scales & 0x0F, scales >> 4
    return _two_bit_values(b[:, 16:80]), (d, sc), (-dmin, mn), 16


def _q3_k(b: np.ndarray):
    hmask, scales, d = b[:, 0:32], b[:, 96:108], _f16(b[:, 108:110])
    # 16 six-bit scales: low nibbles from bytes 0-7 (byte i holds scales i and 8 + i), the
    # top two bits from bytes 8-11 (byte 8 + i holds scales i, 4 + i, 8 + i, 12 + i).
    low = scales[:, 0:8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    top = scales[:, 8:12].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
        1, 4, 1
    )
    sc = ((low.reshape(-1, 16) & 0x0F) | ((top.reshape(-1, 16) & 0x03) << 4)).astype(np.int16)
    # Bit b of hmask[l] is the high bit of value 32b + l; a clear bit subtracts 4.
    high = hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _two_bit_values(b[:, 32:96]).astype(np.int16) - 4 * (1 - (high & 1).reshape(-1, QK_K))
    return q, (d, sc - 32), None, 16


def _q8_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    q = np.ascontiguousarray(b[:, 2:34]).view(np.int8)
    return q, d[:, None], None, 32


_DECODERS = {
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "Q8_0": _q8_0,
}


def dequantize_to(
    type_name: str, data: np.ndarray, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Any GGUF tensor as a dense torch tensor of `dtype` (gguf's own dequantization)."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[type_name]
    values = dequantize(np.asarray(data), qtype).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)
