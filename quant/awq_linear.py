"""AWQLinear: a stacked linear layer whose weights stay 4-bit in memory, and its factory.

The engine stacks q/k/v (and gate/up) into one module; the AWQ tensors of each checkpoint
shard are concatenated along N (qweight/qzeros in units of 8 columns, scales per column):

    qweight [K, N/8] = [ q_proj.qweight | k_proj.qweight | v_proj.qweight ]   (dim 1)

Kernels:
- CUDA: Triton (fused dequant-GEMM for few tokens, dequantize + matmul for many).
- CPU fast path (`cpu_kernel="packed"`): the checkpoint is repacked once into the U4 format
  of quant/packed.py (exactly: scale s, min -z*s per group) and run by the C++ kernels, as
  GGUF 4-bit weights are.
- CPU otherwise: torch's native int4 matmul (`aten._weight_int4pack_mm_for_cpu`) when the shape allows
  it (N % 16 == 0, G in 32/64/128/256), else a tile-wise dequantize + matmul that never holds
  more than a few groups of rows in full precision.
"""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .awq_format import PACK, AWQConfig, dequantize, parse_awq_config, unpack_int4

logger = logging.getLogger(__name__)

# The linear factory's signature (engine/models/layers.py, LinearFactory): (in_features,
# output_sizes, bias, prefixes, dtype, device) -> module. The models' layer sits above this
# one, so its name is not imported here.
LinearFactory = Callable[..., nn.Module]

_NATIVE_GROUP_SIZES = (32, 64, 128, 256)
# torch's int4 CPU matmul is fast (AVX512) for bf16 activations only; in fp32 it is a slow
# generic loop, faster than dequantizing tiles only for a handful of tokens (decode).
_NATIVE_FP32_MAX_TOKENS = 4
_TILE_ELEMENTS = 1 << 18  # full-precision elements per dequantized tile on the tiles path
_AWQ_PARTS = ("qweight", "qzeros", "scales")


def native_int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


class AWQLinear(nn.Module):
    """y [T, N] = x [T, K] Wᵀ + b, W held as AWQ INT4; N = sum(output_sizes).

    `cpu_kernel`: "auto" (native int4 when the shape allows, else tiles), "int4pack" or
    "tiles". On the native path the AWQ tensors are repacked once every shard has been
    loaded. bf16/fp16 models then run torch's bf16 int4 kernel and release the AWQ copies;
    float32 models keep them: exact float32 tiles for prefill, the native kernel in float32
    for decode (up to _NATIVE_FP32_MAX_TOKENS tokens).
    """

    # Buffers (register_buffer), named here for the type checker. The AWQ tensors are set
    # to None once repacked for a CPU kernel (`_release_awq_tensors`), and only read before.
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        group_size: int,
        dtype: torch.dtype,
        device: torch.device,
        cpu_kernel: str = "auto",
    ):
        super().__init__()
        group = in_features if group_size == -1 else group_size
        if in_features % group:
            raise ValueError(f"AWQ group size {group} does not divide in_features {in_features}")
        bad = [n for n in output_sizes if n % PACK]
        if bad:
            raise ValueError(f"AWQ needs output sizes that are multiples of 8, got {bad}")
        if cpu_kernel not in ("auto", "int4pack", "tiles", "packed"):
            raise ValueError(
                f"cpu_kernel must be auto, int4pack, tiles or packed, got {cpu_kernel!r}"
            )
        if cpu_kernel == "packed" and group % 32:
            raise ValueError(f"the packed CPU kernels need AWQ groups of 32k, got {group}")
        self.in_features = in_features
        self.group_size = group
        self.output_sizes = list(output_sizes)
        self.offsets = [0]
        for size in output_sizes:
            self.offsets.append(self.offsets[-1] + size)
        n, k, groups = self.offsets[-1], in_features, in_features // group
        self.out_features = n
        self.dtype = dtype
        self.register_buffer("qweight", torch.zeros(k, n // PACK, dtype=torch.int32, device=device))
        self.register_buffer(
            "qzeros", torch.zeros(groups, n // PACK, dtype=torch.int32, device=device)
        )
        self.register_buffer("scales", torch.zeros(groups, n, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)
        native_ok = n % 16 == 0 and group in _NATIVE_GROUP_SIZES and native_int4_available()
        if cpu_kernel == "int4pack" and not native_ok:
            raise ValueError(
                f"torch's int4 CPU matmul needs N % 16 == 0 and group size in "
                f"{_NATIVE_GROUP_SIZES}; got N={n}, group size {group}"
            )
        self.cpu_kernel = (
            ("int4pack" if native_ok else "tiles") if cpu_kernel == "auto" else cpu_kernel
        )
        self._packed = None  # TiledWeight, on the "packed" path
        self._pending = {(part, s) for part in _AWQ_PARTS for s in range(len(output_sizes))}
        self._int4pack: torch.Tensor | None = None  # uint8 [N, K/2] (torch's own layout)
        self._scales_zeros: torch.Tensor | None = None  # float32 [K/G, N, 2]

    # ------------------------------------------------------------------ loading
    def load(self, suffix: str, tensor: torch.Tensor, shard: int) -> None:
        start, end = self.offsets[shard], self.offsets[shard + 1]
        if suffix == "bias":
            if self.bias is not None:
                _copy(self.bias[start:end], tensor, f"bias shard {shard}")
            return
        if suffix not in _AWQ_PARTS:
            raise ValueError(
                f"unexpected tensor '{suffix}' for an AWQ linear (expected qweight, qzeros, "
                "scales, bias); is the checkpoint a mix of quantized and plain shards?"
            )
        if self._int4pack is not None:
            raise ValueError("this AWQ layer was already loaded and repacked; load it only once")
        if suffix == "scales":
            _copy(self.scales[:, start:end], tensor, f"scales shard {shard}")
        else:
            target = self.qweight if suffix == "qweight" else self.qzeros
            _copy(target[:, start // PACK : end // PACK], tensor, f"{suffix} shard {shard}")
        self._pending.discard((suffix, shard))
        if not self._pending and self.qweight.device.type == "cpu":
            if self.cpu_kernel == "int4pack":
                self._repack_for_cpu()
            elif self.cpu_kernel == "packed":
                self._packed = (
                    awq_to_packed(self.qweight, self.qzeros, self.scales, self.group_size)
                    .compact()
                    .tiled()
                )
                self._release_awq_tensors()
                if self.bias is not None:
                    self.bias = self.bias.float()

    def kernel_segments(self) -> tuple[list[Any], torch.Tensor | None] | None:
        """(segments, float32 bias) of the C++ Linear on the packed path, else None."""
        if self._packed is None:
            return None
        return [self._packed], self.bias

    def kernel_linear(self) -> Any:
        """The C++ Linear the decoder stack runs (the packed path only), or None."""
        return _kernel_linear_of(self)

    def _repack_for_cpu(self) -> None:
        codes = unpack_int4(self.qweight).t().contiguous()  # [N, K]
        self._int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # torch computes w = (q - 8) * s + zp per group; AWQ's (q - z) * s is zp = (8 - z) * s.
        s = self.scales.to(torch.float32)
        z = unpack_int4(self.qzeros).to(torch.float32)
        self._scales_zeros = torch.stack([s, (8 - z) * s], dim=-1).contiguous()
        if self.dtype in (torch.bfloat16, torch.float16):
            # Low-precision models run every token count on the native bf16 kernel: the AWQ
            # copies are not needed any more. float32 models keep them for the exact tiles
            # path (prefill) and use the native kernel in float32 for decode only.
            self._scales_zeros = self._scales_zeros.to(torch.bfloat16)
            self._release_awq_tensors()

    def _release_awq_tensors(self) -> None:
        """Drop the AWQ copies once a CPU kernel holds the weight in its own layout."""
        self.qweight = None  # type: ignore[assignment]  # never read after the repack
        self.qzeros = None  # type: ignore[assignment]
        self.scales = None  # type: ignore[assignment]

    def weight_bytes(self) -> int:
        """Bytes held for the weight (packed codes, zeros, scales, bias)."""
        held = [self.qweight, self.qzeros, self.scales, self.bias, self._int4pack]
        held.append(self._scales_zeros)
        packed = self._packed.nbytes if self._packed is not None else 0
        return packed + sum(t.numel() * t.element_size() for t in held if t is not None)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] in x's dtype."""
        if self._pending:
            missing = sorted({part for part, _ in self._pending})
            raise ValueError(f"AWQ layer used before its checkpoint tensors {missing} were loaded")
        if self._packed is not None:
            from .packed_linear import packed_matmul

            out = packed_matmul(x.float(), self._packed)
        elif x.device.type == "cuda":
            from .awq_triton import awq_linear_triton

            out = awq_linear_triton(x, self.qweight, self.qzeros, self.scales, self.group_size)
        elif self._int4pack is not None and (
            self.qweight is None or x.shape[0] <= _NATIVE_FP32_MAX_TOKENS
        ):
            # bf16 for bf16/fp16 models, else float32; set with _int4pack
            compute = self._scales_zeros.dtype  # type: ignore[union-attr]
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(compute), self._int4pack, self.group_size, self._scales_zeros
            ).to(x.dtype)
        else:
            out = self._forward_tiles(x)
        if self.bias is not None:
            out = out + self.bias
        return out

    def _forward_tiles(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group_size
        groups_per_tile = max(1, _TILE_ELEMENTS // (group * self.out_features))
        x32 = x.to(torch.float32)
        out = torch.zeros(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for g0 in range(0, self.qzeros.shape[0], groups_per_tile):
            g1 = min(g0 + groups_per_tile, self.qzeros.shape[0])
            k0, k1 = g0 * group, g1 * group
            w = dequantize(
                self.qweight[k0:k1], self.qzeros[g0:g1], self.scales[g0:g1], group, torch.float32
            )  # [k1 - k0, N]
            out.addmm_(x32[:, k0:k1], w)
        return out.to(x.dtype)


def awq_to_packed(
    qweight: torch.Tensor,  # int32 [K, N/8]
    qzeros: torch.Tensor,  # int32 [K/G, N/8]
    scales: torch.Tensor,  # float16 [K/G, N]
    group_size: int,
):
    """AWQ's w = (q - z) * s as the U4 format's w = s * q + m with m = -z * s (exact in
    float32), on [N, K] rows, each AWQ group of G split into G / 32 groups of 32."""
    from .packed import U4_GROUP, PackedWeight, pack_u4

    codes = unpack_int4(qweight).t().contiguous()  # [N, K]
    n, k = codes.shape
    s = scales.to(torch.float32).t()  # [N, K/G]
    z = unpack_int4(qzeros).to(torch.float32).t()  # [N, K/G]
    repeat = group_size // U4_GROUP
    scale = s.repeat_interleave(repeat, dim=1).contiguous()
    mins = (-z * s).repeat_interleave(repeat, dim=1).contiguous()
    return PackedWeight("u4", pack_u4(codes), scale, mins, U4_GROUP, (n, k))


class MixedStackedLinear(nn.Module):
    """A stack whose shards differ: some quantized, some kept dense (modules_to_not_convert)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def load(self, suffix: str, tensor: torch.Tensor, shard: int) -> None:
        self.parts[shard].load(suffix, tensor, 0)  # type: ignore[operator]  # every part loads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def kernel_segments(self) -> tuple[list[Any], torch.Tensor | None] | None:
        """Every part's segments in order, with one bias (zeros where a part has none)."""
        segments: list[Any] = []
        biases: list[torch.Tensor | None] = []
        for part in self.parts:
            found = getattr(part, "kernel_segments", lambda: None)()
            if found is None:
                return None
            segments += found[0]
            biases.append(found[1])
        if all(b is None for b in biases):
            return segments, None
        sizes = [
            sum(int(w.shape[0]) for w in part.kernel_segments()[0])  # type: ignore[operator,misc]
            for part in self.parts  # (each part has kernel_segments: checked above)
        ]
        bias = torch.cat(
            [b.float() if b is not None else torch.zeros(n) for b, n in zip(biases, sizes)]
        )
        return segments, bias

    def kernel_linear(self) -> Any:
        """The C++ Linear of every part's segments, or None where a part has no C++ form."""
        return _kernel_linear_of(self)


def _kernel_linear_of(module: nn.Module) -> Any:
    found = module.kernel_segments()  # type: ignore[operator]
    if found is None:
        return None
    from .packed_linear import build_kernel_linear

    segments, bias = found
    return build_kernel_linear(int(segments[0].shape[1]), segments, bias)


def checkpoint_tensor_names(folder: Path) -> set[str]:
    """Names of every tensor in a folder's safetensors files (headers only)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(glob.glob(str(folder / "*.safetensors"))):
        with safe_open(file, framework="pt") as handle:
            names.update(handle.keys())
    return names


# Checkpoints that fuse linears (Phi-3) hold the AWQ tensors of q/k/v under qkv_proj and of
# gate/up under gate_up_proj; the model splits them into its shards as they load.
_FUSED_CHECKPOINT_NAMES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def awq_linear_factory(
    quant_config: dict[str, Any],
    folder: Path,
    cpu_kernel: str = "auto",
    *,
    dense_linear: LinearFactory,
) -> LinearFactory:
    """The engine's LinearFactory for an AutoAWQ gemm checkpoint in `folder`.

    `dense_linear`: the factory of the linears the checkpoint holds unquantized off the fast
    path (the models' `dense_linear`, handed in by the engine that builds the backend).

    A module is quantized iff `<prefix>.qweight` is in the checkpoint, which covers
    modules_to_not_convert whatever matching rule the writer used.
    """
    config: AWQConfig = parse_awq_config(quant_config)
    names = checkpoint_tensor_names(Path(folder))
    if not any(name.endswith(".qweight") for name in names):
        raise ValueError(f"{folder} says it is AWQ but holds no '.qweight' tensors")

    def is_quantized(prefix: str) -> bool:
        if f"{prefix}.qweight" in names:
            return True
        parent, _, leaf = prefix.rpartition(".")  # a shard of a fused checkpoint linear?
        fused = _FUSED_CHECKPOINT_NAMES.get(leaf)
        return fused is not None and f"{parent}.{fused}.qweight" in names

    def make(
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        prefixes: list[str],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        quantized = [is_quantized(prefix) for prefix in prefixes]
        group = config.group_size_for(in_features)

        def dense(sizes: list[int], names: list[str]) -> nn.Module:
            if cpu_kernel == "packed":  # the fast path holds unquantized shards in bf16
                from .packed_linear import PackedStackedLinear

                return PackedStackedLinear(in_features, sizes, bias)
            return dense_linear(in_features, sizes, bias, names, dtype, device)

        if all(quantized):
            return AWQLinear(in_features, output_sizes, bias, group, dtype, device, cpu_kernel)
        if not any(quantized):
            return dense(output_sizes, prefixes)
        logger.info("mixed AWQ / dense stack %s", prefixes)
        parts: list[nn.Module] = [
            AWQLinear(in_features, [size], bias, group, dtype, device, cpu_kernel)
            if is_q
            else dense([size], [prefix])
            for size, prefix, is_q in zip(output_sizes, prefixes, quantized)
        ]
        return MixedStackedLinear(parts)

    return make


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
