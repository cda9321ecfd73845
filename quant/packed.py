"""Packed quantized weights: two exact formats that every GGUF and AWQ type maps onto.

    U4 (4-bit, groups of 32 along K)      w[n, k] = scales[n, g] * q[n, k] + mins[n, g]
        qweight uint8 [N, K/2]            group g = k // 32 is 16 bytes: byte j holds q[j] in
                                          its low nibble and q[j + 16] in its high nibble
        scales, mins float32 [N, K/32]
    I8 (8-bit, groups of G along K)       w[n, k] = scales[n, g] * q[n, k] (+ mins[n, g])
        qweight int8 [N, K]
        scales float32 [N, K/G], mins float32 [N, K/G] or None

The scales and mins are float32 so that every GGUF block type lands here with the exact
values llama.cpp dequantizes it to (a K-quant's scale is its fp16 super-scale times a 6-bit
integer: exact in float32, not in fp16 or bf16). `dequantize` is their torch reference.
A K-quant also keeps its two levels (`KFactors`: the integer multipliers and the factors
of each 256-value super-block), which the kernels' layout stores instead of the products:
1.25 bytes per group and row, not 4 (a Q4_K weight reads 4.6 bits per value, not 6).

These row-major forms are what loading works with (stacking q, k and v, permuting rows,
splitting shards). Once a linear's weight is complete it is repacked, exactly, into the
`TiledWeight` the C++ kernels multiply by (kernels/csrc/linear_packed.cpp: 16 output rows
per tile, 4 K values per 32-bit lane), and the row-major copy is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

U4_GROUP = 32
TILE_ROWS = 16  # output rows per tile of the kernels' layout


K_SUPER = 256  # values of K per K-quant super-block


@dataclass(slots=True)
class KFactors:
    """A K-quant's scales (or mins) in their two levels, whose products are the values:
    value[n, g] = factors[n, g * group // 256] * multipliers[n, g], exact in float32."""

    multipliers: torch.Tensor  # int8 [N, K/G]
    factors: torch.Tensor  # float32 [N, K/256]

    def rows(self, index: slice | torch.Tensor) -> KFactors:
        return KFactors(self.multipliers[index].contiguous(), self.factors[index].contiguous())


@dataclass(slots=True)
class PackedWeight:
    """One packed [N, K] weight in the U4 or I8 format (see the module docstring)."""

    kind: str  # "u4" | "i8"
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    shape: tuple[int, int]  # (N, K)
    # The scales' and mins' two levels, for K-quants (None: one level only).
    scale_factors: KFactors | None = None
    min_factors: KFactors | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.kind == "u4":
            assert self.group == U4_GROUP and tuple(self.qweight.shape) == (n, k // 2)
            assert self.qweight.dtype == torch.uint8 and self.mins is not None
        elif self.kind == "i8":
            assert tuple(self.qweight.shape) == (n, k) and self.qweight.dtype == torch.int8
        else:
            raise ValueError(f"unknown packed weight kind {self.kind!r}")
        assert tuple(self.scales.shape) == (n, k // self.group)
        assert self.scales.dtype in (torch.float32, torch.float16)
        assert self.mins is None or self.mins.dtype == self.scales.dtype
        for parts in (self.scale_factors, self.min_factors):
            assert parts is None or (
                k % K_SUPER == 0
                and tuple(parts.multipliers.shape) == (n, k // self.group)
                and tuple(parts.factors.shape) == (n, k // K_SUPER)
            )

    @property
    def has_k_factors(self) -> bool:
        """Whether every level-two value comes with its factors (the kernels' KScale form)."""
        return self.scale_factors is not None and (
            self.mins is None or self.min_factors is not None
        )

    @property
    def nbytes(self) -> int:
        parts = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K]: the reference of the kernels. scale * q + min is computed
        exactly (float64) and rounded once to float32, as the kernels' fused multiply-add
        does; GGUF's values are exact in float32 anyway. Then cast to `dtype`."""
        n, k = self.shape
        if self.kind == "u4":
            q = unpack_u4(self.qweight).double()  # [N, K]
        else:
            q = self.qweight.double()
        groups = q.view(n, k // self.group, self.group)
        w = groups * self.scales.double()[:, :, None]
        if self.mins is not None:
            w = w + self.mins.double()[:, :, None]
        return w.view(n, k).float().to(dtype)

    def compact(self) -> PackedWeight:
        """Scales and mins stored as float16 when every one of them is exact there (GGUF's
        own fp16 scales are; a K-quant's products of two are not): 20% fewer bytes to read."""
        parts = [self.scales] + ([self.mins] if self.mins is not None else [])
        if self.has_k_factors:  # the kernels store the two levels: 1.25 bytes, not 2
            return self
        if self.scales.dtype == torch.float16 or not all(
            torch.equal(t.half().float(), t) for t in parts
        ):
            return self
        return PackedWeight(
            self.kind,
            self.qweight,
            self.scales.half(),
            None if self.mins is None else self.mins.half(),
            self.group,
            self.shape,
        )

    def rows(self, start: int, end: int) -> PackedWeight:
        """Output rows start:end (a tensor-parallel shard, or one of stacked weights)."""
        return self._select(slice(start, end), end - start)

    def rows_of(self, ids: torch.Tensor) -> PackedWeight:
        """The rows `ids` (an embedding lookup), still packed."""
        return self._select(ids, int(ids.numel()))

    def permute_rows(self, order: torch.Tensor) -> PackedWeight:
        """Rows reordered (undoing llama.cpp's rotary permutation of q and k)."""
        return self._select(order, self.shape[0])

    def _select(self, index: slice | torch.Tensor, count: int) -> PackedWeight:
        return PackedWeight(
            self.kind,
            self.qweight[index].contiguous(),
            self.scales[index].contiguous(),
            None if self.mins is None else self.mins[index].contiguous(),
            self.group,
            (count, self.shape[1]),
            None if self.scale_factors is None else self.scale_factors.rows(index),
            None if self.min_factors is None else self.min_factors.rows(index),
        )

    def tiled(self) -> TiledWeight:
        """The same values in the kernels' tile layout (needs the C++ kernels loaded): K
        factors where the weight has them, else its scales as they are."""
        ops = torch.ops.pagedllm
        kind = self.tile_kind
        tiles = {"u4": ops.tile_u4, "i6": ops.tile_i6, "i8": ops.tile_i8}[kind](self.qweight)
        # u4 tiles with K factors (Q4_K) take the kernels' folded recipe, whose AMX form
        # splits each 6-bit multiplier in two 3-bit parts: other u4 multipliers (none that a
        # GGUF file holds) keep their scales as plain values instead.
        six_bit = kind != "u4" or (
            self.scale_factors is not None
            and bool(
                (
                    (self.scale_factors.multipliers >= 0) & (self.scale_factors.multipliers < 64)
                ).all()
            )
        )
        if self.has_k_factors and six_bit:
            assert self.scale_factors is not None
            scales = _tile_k_factors(self.scale_factors)
            mins = None if self.min_factors is None else _tile_k_factors(self.min_factors)
        else:
            scales = _tile_lanes(self.scales)
            mins = None if self.mins is None else _tile_lanes(self.mins)
        return TiledWeight(kind, tiles, scales, mins, self.group, self.shape)

    @property
    def tile_kind(self) -> str:
        """The kernels' tile format: u4, or for I8 weights i6 where every q fits in -32..31
        (Q2_K to Q6_K: 6 bits a value in memory instead of 8, the same products), else i8."""
        if self.kind == "u4":
            return "u4"
        if self.qweight.numel() == 0:
            return "i8"
        low, high = torch.aminmax(self.qweight)
        return "i6" if int(low) >= -32 and int(high) <= 31 else "i8"


def _tile_lanes(values: torch.Tensor) -> torch.Tensor:
    """Per-row group values [N, G] -> [ceil(N/16), G, 16] (rows padded with zeros)."""
    n, groups = values.shape
    tiles = -(-n // TILE_ROWS)
    padded = values.new_zeros(tiles * TILE_ROWS, groups)
    padded[:n] = values
    return padded.view(tiles, TILE_ROWS, groups).transpose(1, 2).contiguous()


def _tile_k_factors(parts: KFactors) -> torch.Tensor:
    """K factors -> uint8 [T, K/G * 16 + K/256 * 64]: per tile its int8 multipliers
    [K/G, 16], then its float32 factors [K/256, 16] (kernels/csrc/linear_packed.cpp's
    KScale)."""
    multipliers = _tile_lanes(parts.multipliers).view(torch.uint8)
    factors = _tile_lanes(parts.factors).view(torch.uint8)  # float32 bytes
    tiles = multipliers.shape[0]
    return torch.cat([multipliers.reshape(tiles, -1), factors.reshape(tiles, -1)], dim=1)


@dataclass(slots=True)
class TiledWeight:
    """A packed [N, K] weight in the layout of the C++ kernels (kernels/csrc/linear_packed.cpp).

        u4  tiles uint8 [T, K/32, 4, 64]    T = ceil(N / 16) tiles of 16 output rows
        i8  tiles uint8 [T, K/4, 64]        q + 128
        i6  tiles uint8 [T, K/16, 192]      q + 32 in 6 bits (an I8 weight whose q fit)
        scales, mins [T, K/G, 16]           float32 or float16, as the PackedWeight had them,
                     or uint8 [T, K/G * 16 + K/256 * 64]: a K-quant's two levels per tile

    The values are those of the PackedWeight it came from, exactly (`dequantize`)."""

    kind: str  # "u4" | "i8" | "i6" (the i8 ops take i6 tiles too)
    tiles: torch.Tensor
    scales: torch.Tensor  # float32 / float16 [T, K/G, 16], or uint8 K factors [T, bytes]
    mins: torch.Tensor | None
    group: int
    shape: tuple[int, int]  # (N, K)

    @property
    def nbytes(self) -> int:
        parts = [self.tiles, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 -> x @ W^T [M, N] float32, with int8 activations (the kernels'
        recipe: llama.cpp's Q8 blocks of 32, exact integer dot products per weight group);
        written into `out` (contiguous float32 [M, N]) when given."""
        ops = torch.ops.pagedllm
        mins = self.mins if self.mins is not None else _EMPTY
        n = self.shape[0]
        if out is None:
            if self.kind == "u4":
                return ops.u4_tiled_linear(x, self.tiles, self.scales, mins, n)
            return ops.i8_tiled_linear(x, self.tiles, self.scales, mins, self.group, n)
        if self.kind == "u4":
            ops.u4_tiled_linear_out(x, self.tiles, self.scales, mins, n, out)
        else:
            ops.i8_tiled_linear_out(x, self.tiles, self.scales, mins, self.group, n, out)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [*] of W as float32 [*, K] (an embedding lookup)."""
        mins = self.mins if self.mins is not None else _EMPTY
        n, k = self.shape
        return torch.ops.pagedllm.tiled_rows(
            ids, self.tiles, self.scales, mins, self.group, n, k, self.kind == "u4"
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K] (float32 values fma(q, scale, min), then cast)."""
        return self.rows(torch.arange(self.shape[0])).to(dtype)


_EMPTY = torch.empty(0)


def cat_rows(weights: list[PackedWeight]) -> PackedWeight:
    """Stack weights of one format along N (q, k and v into one qkv weight)."""
    first = weights[0]
    assert all(w.kind == first.kind and w.group == first.group for w in weights)
    assert all(w.shape[1] == first.shape[1] for w in weights)
    assert all((w.mins is None) == (first.mins is None) for w in weights)
    # Scales of one dtype: float16 only if every part has float16 scales.
    dtype = (
        torch.float16 if all(w.scales.dtype == torch.float16 for w in weights) else torch.float32
    )
    mins = None
    if first.mins is not None:
        mins = torch.cat([w.mins.to(dtype) for w in weights])  # type: ignore[union-attr]
    # Two levels only where every part has them (else the products alone, as exact).
    with_factors = all(w.has_k_factors for w in weights)
    return PackedWeight(
        first.kind,
        torch.cat([w.qweight for w in weights]),
        torch.cat([w.scales.to(dtype) for w in weights]),
        mins,
        first.group,
        (sum(w.shape[0] for w in weights), first.shape[1]),
        _cat_factors([w.scale_factors for w in weights]) if with_factors else None,
        _cat_factors([w.min_factors for w in weights]) if with_factors else None,
    )


def _cat_factors(parts: list[KFactors | None]) -> KFactors | None:
    if any(p is None for p in parts):
        return None
    present = [p for p in parts if p is not None]
    return KFactors(
        torch.cat([p.multipliers for p in present]), torch.cat([p.factors for p in present])
    )


def unpack_u4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the U4 nibble order -> uint8 values 0..15 [N, K]."""
    n, half = qweight.shape
    blocks = qweight.view(n, half // 16, 16)
    low, high = blocks & 0x0F, blocks >> 4
    return torch.cat([low, high], dim=-1).view(n, half * 2)


def pack_u4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> uint8 [N, K/2] in the U4 nibble order."""
    n, k = q.shape
    groups = q.to(torch.uint8).view(n, k // U4_GROUP, U4_GROUP)
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def quantize_u4(weight: torch.Tensor) -> PackedWeight:
    """Round-to-nearest U4 of a dense [N, K] weight (asymmetric, per group of 32). For tests
    and for dense checkpoints that ask for packing; GGUF and AWQ files map exactly instead."""
    n, k = weight.shape
    if k % U4_GROUP:
        raise ValueError(f"U4 packing needs K divisible by {U4_GROUP}, got {k}")
    groups = weight.float().view(n, k // U4_GROUP, U4_GROUP)
    low = groups.amin(-1)
    high = groups.amax(-1)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((groups - low[..., None]) / scale[..., None]), 0, 15)
    return PackedWeight("u4", pack_u4(q.view(n, k)), scale, low, U4_GROUP, (n, k))
