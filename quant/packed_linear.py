"""The CPU fast path's linear layers: packed quantized or bf16 weights, C++ kernels.

    x [M, K] float32 -> y [M, N] float32

Packed weights (GGUF, AWQ) are held in the kernels' tile layout (`TiledWeight`) and
multiplied with int8 activations: each row of x is quantized in blocks of 32 (llama.cpp's
Q8 activations), each weight group's integer dot product is exact (VNNI), and scales apply
in float32 (kernels/csrc/linear_packed.cpp). Dense weights are held in bf16 and multiplied
with bf16 activations into float32 sums (kernels/csrc/linear_bf16.cpp). Every batch size
runs the same arithmetic in the same order, so a request's outputs do not depend on what
shares its step.

Encoders (embedding models, `encoder_linear`) hold their dense weights in AMX tiles where
the CPU has AMX-BF16 (kernels/csrc/linear_amx_bf16.cpp): still batch-invariant, about 5-7x
faster on a batch of rows, but bits of the tile unit's own that no other CPU reproduces,
which a decoder's greedy tokens may not have and an embedding compared by cosine may.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .gguf_tensor import GGUFTensor
from .packed import PackedWeight, TiledWeight, cat_rows

KernelWeight = TiledWeight | torch.Tensor  # what the fast path's kernels multiply by


def packed_matmul(
    x: torch.Tensor, weight: KernelWeight, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K]^T -> [M, N] float32, into `out` (contiguous
    float32 [M, N]) when given.

    weight: a TiledWeight, or a dense bf16 [N, K] tensor."""
    if isinstance(weight, torch.Tensor):
        if out is None:
            return torch.ops.pagedllm.bf16_linear(x, weight)
        torch.ops.pagedllm.bf16_linear_out(x, weight, out)
        return out
    return weight.matmul(x, out)


def kernel_weight(weight: PackedWeight | torch.Tensor) -> KernelWeight:
    """A complete weight in the form the kernels take: packed ones tiled, dense ones as they are."""
    return weight.tiled() if isinstance(weight, PackedWeight) else weight


def table_weight(value: torch.Tensor | GGUFTensor) -> KernelWeight:
    """An embedding table (or LM head) as the fast path's kernels read it."""
    if isinstance(value, GGUFTensor):
        tiled = tile_in_chunks(value)
        if tiled is not None:
            return tiled
    return kernel_weight(to_fast_weight(value))


TILING_CHUNK_ROWS = 16384  # a multiple of the 16-row tile


def tile_in_chunks(value: GGUFTensor, chunk_rows: int = TILING_CHUNK_ROWS) -> TiledWeight | None:
    """A large packed GGUF weight (a vocabulary's embedding table or LM head) tiled
    `chunk_rows` rows at a time, straight from its blocks, into the whole weight's tile
    tensors: its packed form, as large as the tiles, is never held whole beside them (the
    load of Gemma 3 270M, a 262,144 x 640 Q8_0 table, peaked 190 MiB lower).

    The bits are the whole path's: tiles hold 16 rows each and rows do not mix. None when
    the weight is small, not a packed type, or its chunks chose different tile formats or
    scale types (i6 only where every q fits, float16 scales only where exact): the caller
    then converts it whole, which decides once for all rows."""
    from .gguf_blocks import PACKED_TYPES

    assert chunk_rows % 16 == 0, chunk_rows
    rows, cols = value.shape
    if value.type_name not in PACKED_TYPES or rows <= chunk_rows:
        return None
    first: TiledWeight | None = None
    parts: list[torch.Tensor | None] = []
    for start in range(0, rows, chunk_rows):
        part = kernel_weight(to_fast_weight(value.rows(start, min(rows, start + chunk_rows))))
        assert isinstance(part, TiledWeight)
        if first is None:
            first = part
            num_tiles = -(-rows // 16)
            parts = [
                None if t is None else torch.empty((num_tiles, *t.shape[1:]), dtype=t.dtype)
                for t in (part.tiles, part.scales, part.mins)
            ]
        elif (part.kind, part.group, part.scales.dtype, part.mins is None) != (
            first.kind, first.group, first.scales.dtype, first.mins is None
        ):  # fmt: skip
            return None
        tile = start // 16
        for whole, piece in zip(parts, (part.tiles, part.scales, part.mins)):
            if whole is not None and piece is not None:
                whole[tile : tile + piece.shape[0]] = piece
    assert first is not None and parts[0] is not None and parts[1] is not None
    return TiledWeight(first.kind, parts[0], parts[1], parts[2], first.group, (rows, cols))


def to_fast_weight(value: torch.Tensor | GGUFTensor) -> PackedWeight | torch.Tensor:
    """A checkpoint tensor as the fast path loads it: GGUF blocks packed exactly where a
    packed format exists (a PackedWeight, tiled by `kernel_weight` once its linear is
    complete), everything else a dense bf16 tensor."""
    from .gguf_blocks import PACKED_TYPES, to_packed

    if isinstance(value, GGUFTensor):
        if value.type_name in PACKED_TYPES:
            return to_packed(value.type_name, value.data, value.shape).compact()
        return value.dense(torch.bfloat16)
    return value.to(torch.bfloat16).contiguous()


class PackedStackedLinear(nn.Module):
    """y = x W^T + b with W the stack of several checkpoint linears (q, k, v -> qkv), held
    packed (or bf16) and run by the C++ kernels. Same loading interface as StackedLinear.

    Once every shard is in, consecutive shards of one format are stacked into one weight
    and shards of different formats (a Q4_K q and k beside a Q6_K v, as llama-quantize's
    Q4_K_M writes half of a model's layers) stay segments of their own: `kernel` is the
    C++ Linear over those segments (kernels/csrc/linear.h), whose every output column is
    the bits its own shard's linear would give."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, dense_on_amx: bool = False
    ):
        """dense_on_amx: dense (bf16) shards run on AMX-BF16 tiles (encoder_linear)."""
        super().__init__()
        self.in_features = in_features
        self.dense_on_amx = dense_on_amx
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.shards: list[PackedWeight | torch.Tensor | None] = [None] * len(output_sizes)
        self.segments: list[KernelWeight] = []  # in output-row order, once complete
        self._weight_bytes = 0  # of the weights as the kernels hold them, once complete
        self.kernel: Any = None  # torch.classes.pagedllm.Linear over the segments
        self.bias = torch.zeros(self.out_features) if bias else None
        self._offsets = [0]
        for size in output_sizes:
            self._offsets.append(self._offsets[-1] + size)

    def load(self, suffix: str, tensor: torch.Tensor | GGUFTensor, shard: int) -> None:
        start, end = self._offsets[shard], self._offsets[shard + 1]
        if suffix == "bias" and self.bias is not None:
            dense = tensor.dense() if isinstance(tensor, GGUFTensor) else tensor
            if tuple(dense.shape) != (end - start,):
                raise ValueError(f"bias shard {shard}: shape {tuple(dense.shape)}")
            self.bias[start:end] = dense.float()  # in place: the kernel holds this tensor
            return
        if suffix != "weight":
            raise ValueError(f"unexpected checkpoint tensor '{suffix}' for a linear layer")
        expected = (end - start, self.in_features)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"weight shard {shard}: checkpoint shape {tuple(tensor.shape)} != model {expected}"
            )
        if len(self.shards) == 1 and isinstance(tensor, GGUFTensor):
            tiled = tile_in_chunks(tensor)  # an LM head: never whole in packed form
            if tiled is not None:
                self._complete([tiled])
                return
        self.shards[shard] = to_fast_weight(tensor)
        if all(s is not None for s in self.shards):
            complete = [s for s in self.shards if s is not None]
            self._complete([kernel_weight(w) for w in stack_by_format(complete)])

    def _complete(self, segments: list[KernelWeight]) -> None:
        self.kernel = build_kernel_linear(self.in_features, segments, self.bias, self.dense_on_amx)
        self._weight_bytes = sum(_kernel_weight_bytes(w) for w in segments)
        # Dense weights on AMX tiles live in the kernel's packed copy: holding the bf16
        # tensors too would double an encoder's memory. Such a linear has no segments to
        # offer a mixed stack (only AWQ decoders combine them).
        on_amx = "bf16-amx" in self.kernel.segment_formats()
        self.segments = [] if on_amx else segments
        self.shards = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 -> [T, N] float32."""
        assert self.kernel is not None, "linear layer used before its weights were loaded"
        return torch.ops.pagedllm.linear(self.kernel, x)

    def kernel_linear(self) -> Any:
        """The C++ Linear the decoder stack runs (fused_stack.py)."""
        return self.kernel

    def kernel_segments(self) -> tuple[list[KernelWeight], torch.Tensor | None] | None:
        """(segments, bias) once loaded: what a stack of mixed linears (AWQ) combines;
        None where the kernel alone holds them (dense weights on AMX tiles)."""
        return (self.segments, self.bias) if self.kernel is not None and self.segments else None

    def weight_bytes(self) -> int:
        return self._weight_bytes


def _kernel_weight_bytes(weight: KernelWeight) -> int:
    if isinstance(weight, TiledWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def _format_of(weight: PackedWeight | torch.Tensor) -> tuple:
    """Weights with equal keys stack into one (cat_rows): kind, group and whether mins."""
    if isinstance(weight, PackedWeight):
        return (weight.kind, weight.group, weight.mins is None)
    return ("bf16",)


def stack_by_format(parts: list[PackedWeight | torch.Tensor]) -> list[PackedWeight | torch.Tensor]:
    """Shards in output order -> segments: each run of consecutive shards of one format
    stacked into one weight (q, k, v in Q4_K: one u4 weight; q, k in Q4_K and v in Q6_K: a
    u4 weight and an i8 one). Values are kept exactly: nothing is converted between formats,
    which would cost bytes (a Q4_K weight held as I8 reads 12 bits per value, not 6)."""
    runs: list[list[PackedWeight | torch.Tensor]] = []
    for part in parts:
        if runs and _format_of(runs[-1][0]) == _format_of(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    segments: list[PackedWeight | torch.Tensor] = []
    for run in runs:
        if len(run) == 1:
            segments.append(run[0])
        elif isinstance(run[0], PackedWeight):
            segments.append(cat_rows([p for p in run if isinstance(p, PackedWeight)]))
        else:
            segments.append(torch.cat([p for p in run if isinstance(p, torch.Tensor)]))
    return segments


def build_kernel_linear(
    in_features: int,
    segments: list[KernelWeight],
    bias: torch.Tensor | None,
    dense_on_amx: bool = False,
) -> Any:
    """A torch.classes.pagedllm.Linear over `segments` (output rows in order) and a float32
    bias [N] (held by reference: later in-place writes to it count); dense segments packed
    for AMX-BF16 tiles when `dense_on_amx` (and in_features a multiple of 32)."""
    linear = torch.classes.pagedllm.Linear(in_features)
    for weight in segments:
        if isinstance(weight, TiledWeight):
            mins = weight.mins if weight.mins is not None else _EMPTY
            linear.add_tiled(
                weight.kind == "u4",
                weight.group,
                weight.shape[0],
                weight.tiles,
                weight.scales,
                mins,
            )
        elif dense_on_amx and in_features % 32 == 0:
            linear.add_bf16_amx(weight)
        else:
            linear.add_bf16(weight)
    if bias is not None:
        linear.set_bias(bias)
    return linear


_EMPTY = torch.empty(0)


def packed_linear(
    in_features: int,
    output_sizes: list[int],
    bias: bool,
    prefixes: list[str],
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """The LinearFactory of the CPU fast path (any checkpoint: GGUF, float folders)."""
    return _on_cpu(PackedStackedLinear(in_features, output_sizes, bias), device)


def _on_cpu(module: PackedStackedLinear, device: torch.device) -> PackedStackedLinear:
    if device.type != "cpu":
        raise ValueError("packed linears run on the CPU")
    return module


def amx_bf16_available() -> bool:
    """True where the CPU fast path can hold dense weights in AMX-BF16 tiles."""
    return bool(torch.ops.pagedllm.amx_bf16_enabled())


def encoder_linear(
    in_features: int,
    output_sizes: list[int],
    bias: bool,
    prefixes: list[str],
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """The CPU fast path's LinearFactory for encoders (embedding models): packed_linear's,
    with dense weights on AMX-BF16 tiles where the CPU has them."""
    module = PackedStackedLinear(in_features, output_sizes, bias, amx_bf16_available())
    return _on_cpu(module, device)
