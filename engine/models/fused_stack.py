"""The decoder layers of a model as one C++ call on the CPU fast path.

A one-row decode step runs ~300 small kernels through ~10 Python modules per layer; on a
135M model that Python is ~2 ms of a ~10 ms step, time in which the kernels' threads wait.
`decoder_stack` (kernels/csrc/decoder.cpp) runs the same kernels in the same order from C++,
so its outputs are the module path's bit for bit (tests/test_fused_stack.py checks it).

The C++ side is a registered class, `torch.classes.pagedllm.DecoderStack`, built here once
from the loaded modules: the model's shape and options, its rotary tables, and per layer its
named norms and its four linears as C++ `Linear`s (kernels/csrc/linear.h). The features it
runs are the CPU backend's stack capabilities (backend.py: CPU_STACK). A model needing
another keeps the module path, which stays the reference, and so does one whose layers hold
something unexpected (a linear without a C++ form): CausalLM's `stack_status` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata


class FusedDecoderStack:
    """A model's decoder layers as one `torch.ops.pagedllm.decoder_stack` call."""

    def __init__(self, stack: Any):
        self.stack = stack  # torch.classes.pagedllm.DecoderStack

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] float32: the embedded tokens
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the last layer's MLP output, the residual stream), as the layers hand on."""
        kv = [cache for pair in kv_caches for cache in pair]
        seq_ids = torch.arange(meta.seq_lens.shape[0])
        if meta.layer_groups:  # every group's slots [G, T] and tables [G, B, max_blocks]
            assert meta.group_slot_mappings is not None and meta.group_block_tables is not None
            return torch.ops.pagedllm.decoder_stack(
                self.stack, x, positions, kv, meta.group_slot_mappings, seq_ids,
                meta.cu_seqlens_q, meta.seq_lens, meta.group_block_tables,
                list(meta.layer_groups),
            )  # fmt: skip
        return torch.ops.pagedllm.decoder_stack(
            self.stack, x, positions, kv, meta.slot_mapping, seq_ids, meta.cu_seqlens_q,
            meta.seq_lens, meta.block_tables,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StackShape:
    """What every layer of one stack shares (decoder.cpp's DecoderStack arguments)."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    eps: float
    soft_cap: float
    gelu: bool


def build_fused_stack(model: nn.Module) -> tuple[FusedDecoderStack | None, str]:
    """(the fused stack of a loaded model, "") or (None, why its layers cannot be one)."""
    layers = list(model.layers)  # type: ignore[arg-type]  # an nn.Module attribute (torch types them loosely)
    if not layers:
        return None, "the model has no decoder layers"
    shape: StackShape | None = None
    described: list[tuple[dict[str, torch.Tensor], list[Any], int, Any]] = []
    for index, layer in enumerate(layers):
        parts = _layer_parts(layer)
        if isinstance(parts, str):
            return None, f"layer {index}: {parts}"
        layer_shape, norms, linears, window, rotary = parts
        if shape is None:
            shape = layer_shape
        elif layer_shape != shape:
            return None, f"layer {index} differs from layer 0 in {_difference(shape, layer_shape)}"
        described.append((norms, linears, window, rotary))
    assert shape is not None
    stack = torch.classes.pagedllm.DecoderStack(
        shape.heads, shape.kv_heads, shape.head_dim, shape.scale, shape.eps, shape.soft_cap,
        shape.gelu,
    )  # fmt: skip
    tables: dict[int, int] = {}  # id(rotary module) -> index of its tables in the stack
    for norms, linears, window, rotary in described:
        if id(rotary) not in tables:
            cos, sin = rotary.half_tables()
            tables[id(rotary)] = stack.add_rotary(cos, sin)
        qkv, o, mlp = linears
        if isinstance(mlp, _Experts):
            stack.add_moe_layer(
                norms, qkv, o, mlp.router, mlp.top_k, mlp.norm_topk, window, tables[id(rotary)]
            )
            for gate_up, down in mlp.experts:
                stack.add_expert(gate_up, down)
        else:
            stack.add_layer(norms, qkv, o, *mlp, window, tables[id(rotary)])
    return FusedDecoderStack(stack), ""


@dataclass(frozen=True, slots=True)
class _Experts:
    """An MoE layer's MLP as the stack takes it (decoder.cpp's MoeWeights)."""

    router: torch.Tensor  # float32 [E, H]
    experts: list[tuple[Any, Any]]  # per expert: its gate_up and down C++ Linears
    top_k: int
    norm_topk: bool


def _mlp_parts(mlp: nn.Module) -> tuple[Any, bool] | str:
    """((gate_up, down) or _Experts, gelu) of a gated MLP or an MoE block, or what the
    stack cannot run in it."""
    from .layers import GatedMLP
    from .moe import SparseMoE

    if type(mlp) is GatedMLP:
        return _gated_parts(mlp)
    if type(mlp) is not SparseMoE:
        return f"a {type(mlp).__name__} MLP"
    experts, gelus = [], set()
    for expert in mlp.experts:
        parts = _gated_parts(expert)
        if isinstance(parts, str):
            return f"an expert with {parts}"
        experts.append(parts[0])
        gelus.add(parts[1])
    if len(gelus) != 1 or mlp.gate.weight.dtype != torch.float32:
        return "experts of different activations, or a router that is not float32"
    router = mlp.gate.weight.detach().contiguous()
    return _Experts(router, experts, mlp.top_k, mlp.norm_topk_prob), gelus.pop()


def _gated_parts(mlp: nn.Module) -> tuple[tuple[Any, Any], bool] | str:
    if not mlp.fused:
        return "an activation not on the C++ kernels"
    kernels = [_kernel(lin) for lin in (mlp.gate_up_proj, mlp.down_proj)]  # type: ignore[arg-type]  # an nn.Module attribute (torch types them loosely)
    if any(k is None for k in kernels):
        return "a linear without a C++ form"
    return (kernels[0], kernels[1]), bool(mlp.gelu)


def _kernel(linear: nn.Module) -> Any:
    return getattr(linear, "kernel_linear", lambda: None)()


def _layer_parts(layer: nn.Module) -> Any:
    """(shape, norms, [qkv, o, gate_up, down], sliding window, rotary) of a decoder layer,
    or a string saying what the stack cannot run."""
    from .attention import Attention
    from .causal_lm import DecoderLayer
    from .gemma import GemmaDecoderLayer
    from .layers import RMSNorm

    if type(layer) not in (DecoderLayer, GemmaDecoderLayer):
        return f"a {type(layer).__name__} block"
    attn = layer.self_attn
    if type(attn) is not Attention:
        return f"a {type(attn).__name__} attention"
    mlp_parts = _mlp_parts(layer.mlp)  # type: ignore[arg-type]  # an nn.Module attribute (torch types them loosely)
    if isinstance(mlp_parts, str):
        return mlp_parts
    mlp, gelu = mlp_parts
    names = ["input_layernorm", "post_attention_layernorm"]
    if isinstance(layer, GemmaDecoderLayer):
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    modules = {name: getattr(layer, name) for name in names}
    if attn.q_norm is not None and attn.k_norm is not None:
        modules.update(q=attn.q_norm, k=attn.k_norm)
    eps = {m.eps for m in modules.values() if isinstance(m, RMSNorm)}
    if len(eps) != 1 or not all(type(m) is RMSNorm and m.fused for m in modules.values()):
        return "norms that are not fused RMSNorms of one eps"
    norms = {_NORM_NAMES.get(name, name): _norm_scale(m) for name, m in modules.items()}
    qkv, o = _kernel(attn.qkv_proj), _kernel(attn.o_proj)
    if qkv is None or o is None:
        return "an attention linear without a C++ form"
    if not attn.rotary.fused:
        return "a rotary embedding not on the C++ kernels"
    shape = StackShape(
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        float(attn.scale),
        float(eps.pop()),
        float(attn.logits_soft_cap or 0.0),
        gelu,
    )
    return shape, norms, [qkv, o, mlp], int(attn.sliding_window or 0), attn.rotary


# Module attribute -> the stack's norm name (decoder.cpp's add_layer).
_NORM_NAMES = {
    "input_layernorm": "input",
    "post_attention_layernorm": "post_attention",
    "pre_feedforward_layernorm": "pre_feedforward",
    "post_feedforward_layernorm": "post_feedforward",
}


def _norm_scale(norm: nn.Module) -> torch.Tensor:
    """What the fused norm kernel multiplies by (w, or Gemma's 1 + w), float32 contiguous,
    computed as the module path computes it."""
    return norm._scale().float().contiguous()  # type: ignore[operator]  # an nn.Module attribute (torch types them loosely)


def _difference(a: StackShape, b: StackShape) -> str:
    fields = [f for f in StackShape.__slots__ if getattr(a, f) != getattr(b, f)]  # type: ignore[attr-defined]
    return ", ".join(fields)
