"""GGUF files as llama.cpp's `llama-quantize` writes them, without the binary.

`mix_type` chooses each tensor's type as llama-quantize does for its Q2_K .. Q8_0 presets
(llama.cpp src/llama-quant.cpp: the preset's default type, the per-tensor bumps, the
fallbacks for rows that are not whole blocks of the chosen type, and --pure), and the
`encode_*` functions write K-quant blocks (gguf-py can only decode them) by plain
round-to-nearest, in the exact byte layouts gguf-py's dequantizers read. Their values are
not llama.cpp's (its search for scales is better); what the tests need is files of the same
types, mixes and layouts, whose float dequantization the engine's paths are compared with.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


# --------------------------------------------------------------- the presets' type rules
def _use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


_DEFAULT = {
    "Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
    "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q8_0": "Q8_0",
}  # fmt: skip
PRESETS = tuple(_DEFAULT)
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32}


def mix_type(
    preset: str,
    name: str,
    shape: tuple[int, ...],
    *,
    layer: int,
    layers: int,
    gqa: int,
    experts: int,
    tied: bool,
    pure: bool = False,
) -> str | None:
    """The GGML type llama-quantize gives tensor `name` (numpy `shape`, rows last) under
    `preset`, or None where it keeps the tensor as it is (1-D tensors, norms, routers)."""
    if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return None
    if "ffn_gate_inp" in name:
        return None
    chosen = _DEFAULT[preset]
    if not pure:
        chosen = _bumped(preset, chosen, name, shape, layer, layers, gqa, experts, tied)
    columns = shape[-1]
    block = _BLOCK.get(chosen, QK_K)
    if columns % block:
        chosen = _FALLBACK.get(chosen, chosen)
        if columns % _BLOCK.get(chosen, QK_K):
            return "F16"
    return chosen


def _bumped(preset, chosen, name, shape, layer, layers, gqa, experts, tied) -> str:
    is_output = name == "output.weight" or (tied and name == "token_embd.weight")
    if is_output:
        if shape[-1] % _BLOCK.get(chosen, QK_K):
            return "Q8_0"
        return "Q8_0" if chosen == "Q8_0" else "Q6_K"
    if name == "token_embd.weight":
        return chosen
    if ".attn_v." in name:
        if preset == "Q2_K":
            chosen = "Q4_K" if gqa >= 4 else "Q3_K"
        elif preset == "Q2_K_S" and gqa >= 4:
            chosen = "Q4_K"
        elif preset == "Q3_K_M":
            chosen = "Q5_K" if layer < 2 else "Q4_K"
        elif preset == "Q3_K_L":
            chosen = "Q5_K"
        elif preset in ("Q4_K_M", "Q5_K_M") and _use_more_bits(layer, layers):
            chosen = "Q6_K"
        elif preset == "Q4_K_S" and layer < 4:
            chosen = "Q5_K"
        return "Q8_0" if experts == 8 else chosen
    if ".attn_k." in name:
        return "Q8_0" if experts == 8 else chosen
    if ".ffn_down" in name:
        if preset == "Q2_K":
            return "Q3_K"
        if preset == "Q2_K_S":
            return "Q4_K" if layer < layers // 8 else chosen
        if preset == "Q3_K_M":
            return "Q5_K" if layer < layers // 16 else "Q4_K"
        if preset == "Q3_K_L":
            return "Q5_K"
        if preset in ("Q4_K_M", "Q5_K_M") and _use_more_bits(layer, layers):
            return "Q6_K"
        if preset == "Q4_K_S" and layer < layers // 8:
            return "Q5_K"
        return chosen
    if ".attn_output." in name:
        if experts == 8:
            bumped = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M")
            return "Q5_K" if preset in bumped else chosen
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(preset, chosen)
    if ".attn_qkv." in name:
        return {"Q3_K_M": "Q4_K", "Q3_K_L": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(
            preset, chosen
        )
    return chosen


# ------------------------------------------------------------------- K-quant blocks
def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _fp16(values: np.ndarray) -> np.ndarray:
    """Values as they will read back (rounded to fp16), float32."""
    return values.astype(np.float16).astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _two_bit_bytes(q: np.ndarray) -> np.ndarray:
    """256 values 0..3 per block -> 64 bytes: byte 32i + l holds value 128i + 32s + l at
    bits 2s (the layout gguf-py's Q2_K / Q3_K decoders read)."""
    v = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (v[:, :, 0] | v[:, :, 1] << 2 | v[:, :, 2] << 4 | v[:, :, 3] << 6).reshape(-1, 64)


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """256 values 0..15 -> 128 bytes: chunk c of 32 bytes holds sub-block 2c in its low
    nibbles and 2c + 1 in its high ones (Q4_K, Q5_K)."""
    v = q.reshape(-1, 4, 2, 32).astype(np.uint8)
    return (v[:, :, 0] | v[:, :, 1] << 4).reshape(-1, 128)


def _scale_min_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> the 12 bytes of a Q4_K / Q5_K block."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1)


def _asymmetric(x: np.ndarray, levels: int, scale_bits: int):
    """Per sub-block (rows of x) w = d*sc*q - dmin*m: super-block d, dmin and integer
    sc, m of `scale_bits` bits, q in 0..levels. Returns (q, sc, m, d, dmin) per block."""
    low = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - low) / levels
    top = (1 << scale_bits) - 1
    d = _fp16(scale.max(axis=1) / top)
    dmin = _fp16((-low).max(axis=1) / top)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, top)
    m = np.clip(np.rint(_safe_div(-low, dmin[:, None])), 0, top)
    step = d[:, None] * sc
    q = np.clip(np.rint(_safe_div(x + (dmin[:, None] * m)[..., None], step[..., None])), 0, levels)
    return q.astype(np.uint8), sc, m, d, dmin


def encode_q2_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _asymmetric(x.reshape(-1, 16, 16).astype(np.float32), 3, 4)
    scales = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4)).reshape(-1, 16)
    return np.concatenate([scales, _two_bit_bytes(q), _fp16_bytes(d), _fp16_bytes(dmin)], 1)


def encode_q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(axis=2) / 4  # q in -4..3
    d = _fp16(scale.max(axis=1) / 31)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -32, 31)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(_safe_div(sub, np.broadcast_to(step, sub.shape).copy())), -4, 3)
    q = (q + 4).astype(np.uint8).reshape(-1, QK_K)  # 0..7: bit 2 is the hmask bit
    hmask = (q >> 2).reshape(-1, 8, 32)
    hbytes = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for bit in range(8):
        hbytes |= (hmask[:, bit] & 1) << bit
    s = (sc + 32).astype(np.uint8)  # 6 bits
    low = (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4)
    top = s >> 4
    high = top[:, 0:4] | top[:, 4:8] << 2 | top[:, 8:12] << 4 | top[:, 12:16] << 6
    body = np.concatenate([hbytes, _two_bit_bytes(q & 3), low, high], 1)
    return np.concatenate([body, _fp16_bytes(d)], 1)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _asymmetric(x.reshape(-1, 8, 32).astype(np.float32), 15, 6)
    head = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _scale_min_bytes(sc, m)], 1)
    return np.concatenate([head, _nibble_bytes(q.reshape(-1, QK_K))], 1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _asymmetric(x.reshape(-1, 8, 32).astype(np.float32), 31, 6)
    q = q.reshape(-1, 8, 32)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):  # bit j of qh[l] is the fifth bit of sub-block j's value l
        qh |= ((q[:, j] >> 4) & 1) << j
    head = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _scale_min_bytes(sc, m)], 1)
    return np.concatenate([head, qh, _nibble_bytes((q & 0x0F).reshape(-1, QK_K))], 1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(axis=2) / 31
    d = _fp16(scale.max(axis=1) / 127)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127)
    step = np.broadcast_to((d[:, None] * sc)[..., None], sub.shape).copy()
    q = (np.clip(np.rint(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # value 128h + 32s + l
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | low[:, :, 2] << 4, low[:, :, 1] | low[:, :, 3] << 4], 2)
    qh = high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, _fp16_bytes(d)], 1)


ENCODERS = {
    "Q2_K": encode_q2_k,
    "Q3_K": encode_q3_k,
    "Q4_K": encode_q4_k,
    "Q5_K": encode_q5_k,
    "Q6_K": encode_q6_k,
}


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [..., K] -> the raw blocks gguf's writer takes for `type_name` (uint8
    [..., bytes per row]; F16 as float16 values)."""
    import gguf
    from gguf.quants import quantize as gguf_quantize

    values = np.ascontiguousarray(values, dtype=np.float32)
    if type_name == "F16":
        return values.astype(np.float16)
    if type_name in ENCODERS:
        rows = values.reshape(-1, values.shape[-1])
        blocks = ENCODERS[type_name](rows.reshape(-1, QK_K))
        return blocks.reshape(*values.shape[:-1], -1)
    return gguf_quantize(values, gguf.GGMLQuantizationType[type_name])
