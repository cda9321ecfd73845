"""Building blocks of the Llama family: RMSNorm, rotary embeddings, stacked linears.

The numerics follow Hugging Face transformers step for step (RMSNorm in float32, cos/sin
cast to the activation dtype) so that greedy outputs match it token for token.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


def _fused_ops():
    return torch.ops.pagedllm


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add that precedes it.

    `norm(x)` -> normed x. `norm(x, residual)` -> (normed (residual + x), residual + x): the
    pre-norm of a sub-layer that first adds the previous sub-layer's output to the residual
    stream. With `fused` (the CPU fast path) one C++ kernel does both, in place.
    """

    fused = False  # set per instance by enable_fused_cpu_kernels

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if self.fused:
                return _fused_ops().add_rms_norm(x, residual, self.weight, self.eps), residual
            residual = x + residual
            return self._norm(residual), residual
        if self.fused:
            return _fused_ops().rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class LoadableLinear(Protocol):
    """A linear layer whose output is the concatenation of one or more checkpoint shards."""

    def load(self, suffix: str, tensor: torch.Tensor, shard: int) -> None: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class StackedLinear(nn.Module):
    """y = x W^T + b where W stacks several checkpoint linears along the output dim.

    q/k/v become one matmul and gate/up another: fewer, larger GEMMs, which matters on CPU
    where a decode step is dominated by per-call overhead.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.offsets = [0]
        for size in output_sizes:
            self.offsets.append(self.offsets[-1] + size)
        out_features = self.offsets[-1]
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def load(self, suffix: str, tensor: Any, shard: int) -> None:
        from ..gguf_loader import as_dense

        start, end = self.offsets[shard], self.offsets[shard + 1]
        tensor = as_dense(tensor, self.weight.dtype)
        if suffix == "weight":
            _copy_checked(self.weight.data[start:end], tensor, f"weight shard {shard}")
        elif suffix == "bias" and self.bias is not None:
            _copy_checked(self.bias.data[start:end], tensor, f"bias shard {shard}")
        else:
            raise ValueError(f"unexpected checkpoint tensor '{suffix}' for a linear layer")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)


class LinearFactory(Protocol):
    """Makes the linear layers of a model; quantization plugs in here."""

    def __call__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        prefixes: list[str],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module: ...


def dense_linear(
    in_features: int,
    output_sizes: list[int],
    bias: bool,
    prefixes: list[str],
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    return StackedLinear(in_features, output_sizes, bias, dtype, device)


# ------------------------------------------------------------------ rotary
def rope_inv_freq(
    head_dim: int, rope_theta: float, scaling: dict[str, Any] | None, max_model_len: int
) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32) of a rope config.

    Supported `rope_type`s: default, linear, dynamic (NTK), llama3. `dynamic` is computed
    once for `max_model_len` (as vLLM does): identical to transformers while sequences stay
    within the original context, consistent across positions beyond it.
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
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    if rope_type in ("default", "dynamic"):
        pass
    elif rope_type == "linear" and scaling is not None:
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3" and scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    else:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported (default, linear, dynamic, llama3)"
        )
    return inv_freq


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
    """Neox-style rotary embedding (rotate_half), cos/sin cached for every position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope_theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope_theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos().to(dtype).to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype).to(device), persistent=False)
        # Every layer of one forward pass gets the same positions tensor: look its cos/sin
        # rows up once per pass, not once per layer.
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        # The fused kernel reads cos/sin [P, D/2] (the two halves of each row are equal).
        self._half_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    fused = False  # set per instance by enable_fused_cpu_kernels

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D] -> rotated q, k (in place when fused)."""
        if self.fused:
            half = self.cos.shape[1] // 2
            if self._half_tables is None:
                self._half_tables = (
                    self.cos[:, :half].float().contiguous(),
                    self.sin[:, :half].float().contiguous(),
                )
            _fused_ops().rotary_neox_(q, k, positions, *self._half_tables)
            return q, k
        if positions is not self._positions or self._cos_sin is None:
            self._cos_sin = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
            self._positions = positions
        cos, sin = self._cos_sin  # [T, 1, D] each
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# --------------------------------------------------------- embedding and head
class VocabEmbedding(nn.Module):
    """The token embedding table [vocab, hidden].

    On the CPU fast path (`fused`) the table is kept as the checkpoint gives it: a packed
    quantized GGUF table stays packed (rows are dequantized as they are looked up) and a
    float one is held in bf16; no float32 copy is made. Output: [T, hidden] in `dtype`.
    """

    def __init__(
        self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, fused: bool
    ):
        super().__init__()
        self.fused = fused
        self.dtype = dtype
        self.shape = (vocab, hidden)
        self.weight: torch.Tensor | None = None
        self.fast_weight: Any = None  # PackedWeight or bf16 tensor, on the fast path
        if not fused:
            self.weight = nn.Parameter(
                torch.empty(vocab, hidden, dtype=dtype, device=device), requires_grad=False
            )

    def load(self, tensor: Any) -> None:
        from ..gguf_loader import as_dense

        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"embedding: checkpoint shape {tuple(tensor.shape)} != {self.shape}")
        if self.fused:
            from ...quant.packed_linear import to_fast_weight

            self.fast_weight = to_fast_weight(tensor)
        else:
            assert self.weight is not None
            self.weight.data.copy_(as_dense(tensor, self.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return F.embedding(input_ids, self.weight)
        table = self.fast_weight
        if isinstance(table, torch.Tensor):
            return F.embedding(input_ids, table).to(self.dtype)
        if table.kind == "i8":
            mins = table.mins if table.mins is not None else torch.empty(0)
            return (
                _fused_ops()
                .i8_embedding(input_ids, table.qweight, table.scales, mins, table.group)
                .to(self.dtype)
            )
        return table.rows_of(input_ids).dequantize(self.dtype)


class LMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] float32; its own weight or the embedding's."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool,
        tied_to: VocabEmbedding | None = None,
    ):
        super().__init__()
        self.fused = fused
        # The tied embedding module is not registered as a child (it is the model's).
        self._tied = [tied_to] if tied_to is not None else []
        self.own = (
            None if tied_to is not None else VocabEmbedding(vocab, hidden, dtype, device, fused)
        )

    @property
    def table(self) -> VocabEmbedding:
        return self._tied[0] if self._tied else self.own  # type: ignore[return-value]

    def load(self, tensor: Any) -> None:
        if self.own is not None:
            self.own.load(tensor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        table = self.table
        if not self.fused:
            return F.linear(hidden, table.weight).float()
        from ...quant.packed_linear import packed_matmul

        return packed_matmul(hidden.float(), table.fast_weight)


def silu_and_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    if fused:
        return _fused_ops().gated_act(gate_up, False)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def enable_fused_cpu_kernels(model: nn.Module) -> None:
    """Switch a model's norms and rotary embeddings to the C++ kernels (the CPU fast path)."""
    for module in model.modules():
        if isinstance(module, RMSNorm | RotaryEmbedding):
            module.fused = True
