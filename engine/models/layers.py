"""Building blocks shared by every model family: RMSNorm, stacked linears, the gated MLP,
the token embedding and LM head (rotary embeddings: rotary.py).

The numerics follow Hugging Face transformers step for step (RMSNorm in float32 in each
family's order of cast and multiply) so that greedy outputs match it token for token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# Rotary embeddings live in rotary.py; the names stay importable from here.
from .rotary import RotaryEmbedding as RotaryEmbedding
from .rotary import rope_attention_factor as rope_attention_factor
from .rotary import rope_inv_freq as rope_inv_freq


def _fused_ops():
    return torch.ops.pagedllm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, optionally fused with the residual add that precedes it.

    `norm(x)` -> normed x. `norm(x, residual)` -> (normed (residual + x), residual + x): the
    pre-norm of a sub-layer that first adds the previous sub-layer's output to the residual
    stream. With `fused` (the CPU fast path) one C++ kernel does both, in place.

    unit_offset=False (Llama, Qwen, Phi): normalize in float32, cast, multiply by w.
    unit_offset=True (Gemma): the checkpoint stores w - 1; multiply by (1 + w) in float32,
    then cast (the order matters for bf16: it is how transformers computes each family).
    `fused`: the backend's C++ kernel (backend.fused_kernels), fixed at construction.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        unit_offset: bool = False,
        fused: bool = False,
    ):
        super().__init__()
        self.fused = fused
        initial = torch.zeros if unit_offset else torch.ones
        self.weight = nn.Parameter(initial(hidden_size, dtype=dtype, device=device))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if self.fused:
                weight = self._scale()
                return _fused_ops().add_rms_norm(x, residual, weight, self.eps), residual
            residual = x + residual
            return self._norm(residual), residual
        if self.fused:
            return _fused_ops().rms_norm(x, self._scale(), self.eps)
        return self._norm(x)

    def _scale(self) -> torch.Tensor:
        """What the fused kernel multiplies by: w, or Gemma's 1 + w (float32, as it computes)."""
        return self.weight + 1.0 if self.unit_offset else self.weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(input_dtype)
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


# Where a linear's checkpoint tensors hold its output features: dense weight [N, K] and
# bias [N] along dim 0; AWQ qweight/qzeros [K/G or K, N/8] along dim 1 in units of 8
# columns, scales [K/G, N] along dim 1.
_OUTPUT_DIM_AND_UNIT = {"weight": (0, 1), "bias": (0, 1), "qweight": (1, 8), "qzeros": (1, 8)}


def split_fused(suffix: str, tensor: Any, sizes: list[int]) -> list[Any]:
    """Cut a checkpoint tensor of several fused linears (Phi-3's qkv_proj [q|k|v] and
    gate_up_proj [gate|up]) into one piece per linear, along its output features.

    `sizes` may be proportional (a tensor-parallel rank's share of each): the pieces keep
    those proportions of the full tensor.
    """
    dim, unit = _OUTPUT_DIM_AND_UNIT.get(suffix, (1, 1))  # AWQ scales: dim 1, per column
    if not isinstance(tensor, torch.Tensor):  # a quantized GGUF weight: cut whole rows
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size * (tensor.shape[0] // sum(sizes)))
        return [tensor.rows(a, b) for a, b in itertools.pairwise(starts)]
    total = tensor.shape[dim] * unit
    if total % sum(sizes):
        raise ValueError(
            f"fused '{suffix}' of shape {tuple(tensor.shape)} cannot be split as {sizes}"
        )
    widths = [size * (total // sum(sizes)) for size in sizes]
    if any(width % unit for width in widths):
        raise ValueError(f"fused '{suffix}': pieces {widths} are not whole units of {unit}")
    return list(tensor.split([width // unit for width in widths], dim=dim))


def as_dense(value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as a dense torch tensor of `dtype`, whatever form it came in: a
    quantized one (quant/gguf_tensor.py's GGUFTensor, a weight format, which the models do
    not import) dequantizes itself."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    return value.dense(torch.float32).to(dtype)


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


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up stacked in one matmul.

    act: silu (SwiGLU: Llama, Qwen, Phi) or gelu_pytorch_tanh (GeGLU: Gemma). `prefix` names
    the checkpoint module (model.layers.3.mlp, or model.layers.3.mlp.experts.7 for an expert).
    With `fused` (the CPU fast path) the activation is one C++ kernel over [gate | up].
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        act: str,
        prefix: str,
        make_linear: LinearFactory,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
    ):
        super().__init__()
        self.fused = fused
        if act not in _ACTIVATIONS:
            raise ValueError(f"MLP activation {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        self.intermediate = intermediate_size
        self.act = _ACTIVATIONS[act]
        self.gelu = act != "silu"
        self.gate_up_proj = make_linear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias,
            [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
            dtype,
            device,
        )
        self.down_proj = make_linear(
            intermediate_size, [hidden_size], bias, [f"{prefix}.down_proj"], dtype, device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.fused:
            return self.down_proj(_fused_ops().gated_act(gate_up, self.gelu))
        gate, up = gate_up.split([self.intermediate, self.intermediate], dim=-1)
        return self.down_proj(self.act(gate) * up)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
}


# --------------------------------------------------------- embedding and head
@dataclass(frozen=True, slots=True)
class TableKernels:
    """How the CPU fast path holds an embedding table and multiplies by it (a tied head).

    `to_kernel(checkpoint tensor)` -> the kernels' weight (a packed table in their tiles,
    or bf16); `matmul(x, weight, out=)` -> x @ weight^T into `out`. The weight formats live
    in quant/ (packed_linear.py), which the models do not import: the engine hands these in
    through the backend, as it hands in the linear factory.
    """

    to_kernel: Callable[[Any], Any]
    matmul: Callable[..., torch.Tensor]


class VocabEmbedding(nn.Module):
    """The token embedding table [vocab, hidden].

    On the CPU fast path (`fused`) the table is kept as the checkpoint gives it: a packed
    quantized GGUF table stays packed, in the kernels' tile layout, so that a tied LM head
    multiplies by the same bytes (rows are dequantized as they are looked up), and a float
    one is held in bf16; no float32 copy is made. Output: [T, hidden] in `dtype`.
    """

    def __init__(
        self,
        vocab: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool,
        tables: TableKernels | None = None,
    ):
        super().__init__()
        self.fused = fused
        self.tables = tables
        self.dtype = dtype
        self.shape = (vocab, hidden)
        self.weight: torch.Tensor | None = None
        self.fast_weight: Any = None  # TiledWeight or bf16 tensor, on the fast path
        if not fused:
            self.weight = nn.Parameter(
                torch.empty(vocab, hidden, dtype=dtype, device=device), requires_grad=False
            )

    def load(self, tensor: Any) -> None:
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"embedding: checkpoint shape {tuple(tensor.shape)} != {self.shape}")
        if self.fused:
            self.fast_weight = self._tables().to_kernel(tensor)
        else:
            assert self.weight is not None
            self.weight.data.copy_(as_dense(tensor, self.dtype))

    def _tables(self) -> TableKernels:
        if self.tables is None:
            raise ValueError(
                "the CPU fast path's embedding needs its backend's table kernels "
                "(Backend.tables): build the backend with backend_for(..., tables=...)"
            )
        return self.tables

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return F.embedding(input_ids, self.weight)  # type: ignore[arg-type]  # set unfused
        table = self.fast_weight
        if isinstance(table, torch.Tensor):
            return F.embedding(input_ids, table).to(self.dtype)
        return table.rows(input_ids).to(self.dtype)


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
        tables: TableKernels | None = None,
    ):
        super().__init__()
        self.fused = fused
        # The tied embedding module is not registered as a child (it is the model's).
        self._tied = [tied_to] if tied_to is not None else []
        self.own = (
            None
            if tied_to is not None
            else VocabEmbedding(vocab, hidden, dtype, device, fused, tables)
        )

    @property
    def table(self) -> VocabEmbedding:
        return self._tied[0] if self._tied else self.own  # type: ignore[return-value]

    def load(self, tensor: Any) -> None:
        if self.own is not None:
            self.own.load(tensor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fused path's logits are a view of the calling thread's step workspace
        (kernels/csrc/decoder.cpp), which the decoder stack's buffers share: they are valid
        until this thread's next forward pass. The engine samples from them within the
        step, so a decode step of 64 sequences holds its 12.6 MB of logits in memory that
        a prompt step's layer buffers used, instead of allocating them."""
        table = self.table
        if not self.fused:
            return F.linear(hidden, table.weight).float()  # type: ignore[arg-type]  # set unfused
        weight = table.fast_weight
        rows, vocab = hidden.shape[0], int(weight.shape[0])
        logits = torch.ops.pagedllm.step_workspace(rows * vocab).view(rows, vocab)
        return table._tables().matmul(hidden.float(), weight, out=logits)
