"""The CPU fast path's linear layers: packed quantized or bf16 weights, C++ kernels.

    x [M, K] float32 -> y [M, N] float32

Packed weights (GGUF, AWQ) are held in the kernels' tile layout (`TiledWeight`) and
multiplied with int8 activations: each row of x is quantized in blocks of 32 (llama.cpp's
Q8 activations), each weight group's integer dot product is exact (VNNI), and scales apply
in float32 (kernels/csrc/linear_packed.cpp). Dense weights are held in bf16 and multiplied
with bf16 activations into float32 sums (kernels/csrc/linear_bf16.cpp). Every batch size
runs the same arithmetic in the same order, so a request's outputs do not depend on what
shares its step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine.gguf_loader import GGUFTensor
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
    packed (or bf16) and run by the C++ kernels. Same loading interface as StackedLinear."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.shards: list[PackedWeight | torch.Tensor | None] = [None] * len(output_sizes)
        self.weight: KernelWeight | None = None  # the stack, tiled for the kernels, once complete
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
            self.bias[start:end] = dense.float()
            return
        if suffix != "weight":
            raise ValueError(f"unexpected checkpoint tensor '{suffix}' for a linear layer")
        expected = (end - start, self.in_features)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"weight shard {shard}: checkpoint shape {tuple(tensor.shape)} != model {expected}"
            )
        self.shards[shard] = to_fast_weight(tensor)
        if all(s is not None for s in self.shards):
            self.weight = kernel_weight(_stack([s for s in self.shards if s is not None]))
            self.shards = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 -> [T, N] float32."""
        assert self.weight is not None, "linear layer used before its weights were loaded"
        out = packed_matmul(x, self.weight)
        return out if self.bias is None else out + self.bias

    def weight_bytes(self) -> int:
        w = self.weight
        if isinstance(w, TiledWeight):
            return w.nbytes
        return 0 if w is None else w.numel() * w.element_size()


def _stack(parts: list[PackedWeight | torch.Tensor]) -> PackedWeight | torch.Tensor:
    """One weight for a stack of shards. Shards of one packed format are concatenated;
    mixed shards (a Q4_K q next to a Q6_K v, as llama.cpp's Q4_K_M files have) become one
    I8 weight (U4 values are exact in I8) or, with a dense shard among them, bf16."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, PackedWeight) for p in parts):
        packed = [p for p in parts if isinstance(p, PackedWeight)]
        if len({(p.kind, p.group) for p in packed}) == 1:
            return cat_rows(packed)
        group = min(p.group for p in packed)
        return cat_rows([_as_i8(p, group) for p in packed])
    return torch.cat(
        [p.dequantize(torch.bfloat16) if isinstance(p, PackedWeight) else p for p in parts]
    )


def _as_i8(weight: PackedWeight, group: int) -> PackedWeight:
    """The same values in the I8 format with groups of `group` (which divides the weight's)."""
    from .packed import unpack_u4

    if weight.kind == "i8" and weight.group == group:
        return weight
    q = unpack_u4(weight.qweight).to(torch.int8) if weight.kind == "u4" else weight.qweight
    repeat = weight.group // group
    scales = weight.scales.repeat_interleave(repeat, dim=1)
    mins = None if weight.mins is None else weight.mins.repeat_interleave(repeat, dim=1)
    return PackedWeight("i8", q, scales, mins, group, weight.shape)


def packed_linear(
    in_features: int,
    output_sizes: list[int],
    bias: bool,
    prefixes: list[str],
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """The LinearFactory of the CPU fast path (any checkpoint: GGUF, float folders)."""
    if device.type != "cpu":
        raise ValueError("packed linears run on the CPU")
    return PackedStackedLinear(in_features, output_sizes, bias)
