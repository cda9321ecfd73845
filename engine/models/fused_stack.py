"""The decoder layers of a Llama-family model as one C++ call on the CPU fast path.

A one-row decode step runs ~300 small kernels through ~10 Python modules per layer; on a
135M model that Python is ~2 ms of a ~10 ms step, time in which the kernels' threads wait.
`decoder_stack` (kernels/csrc/decoder.cpp) runs the same kernels in the same order from C++,
so its outputs are the module path's bit for bit (tests/test_fused_stack.py checks it).

It applies to models built exactly from the shared layers: `DecoderLayer` with `Attention`
(no q/k norms, no soft-cap, one rotary table turning whole heads) and a SiLU `GatedMLP`,
plain RMSNorms, and packed or bf16 `PackedStackedLinear`s. Anything else (Gemma's
sandwich norms, Qwen3's q/k norms, Phi-4-mini's partial rotary, MoE, AWQ linears) keeps the
module path, which stays the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...quant.packed import TiledWeight
from ..attention_metadata import AttentionMetadata

_EMPTY = torch.empty(0)
_KINDS = {"bf16": 0, "u4": 1, "i8": 2}


class FusedDecoderStack:
    """Flat arguments of `torch.ops.pagedllm.decoder_stack` for one model, gathered once."""

    def __init__(self, params: list[torch.Tensor], ints: list[int], rotary: Any, config: Any):
        self.params = params
        self.ints = ints
        self.cos, self.sin = rotary
        self.scale = float(config["scale"])
        self.eps = float(config["eps"])
        self.heads, self.kv_heads, self.head_dim = config["shape"]

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
        return torch.ops.pagedllm.decoder_stack(
            x, positions, self.params, self.ints, kv, self.cos, self.sin, meta.slot_mapping,
            seq_ids, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, self.scale, self.eps,
            self.heads, self.kv_heads, self.head_dim,
        )  # fmt: skip


def build_fused_stack(model: nn.Module) -> FusedDecoderStack | None:
    """The fused stack of a loaded model, or None when its layers are not all the plain
    Llama-family layers the C++ stack implements (see the module docstring)."""
    from ...quant.packed_linear import PackedStackedLinear
    from .attention import Attention
    from .causal_lm import DecoderLayer
    from .layers import GatedMLP, RMSNorm

    layers = list(model.layers)
    if not layers or type(layers[0]) is not DecoderLayer:
        return None
    first = layers[0].self_attn
    rotary = first.rotary
    params: list[torch.Tensor] = []
    ints: list[int] = []
    eps = layers[0].input_layernorm.eps
    for layer in layers:
        if type(layer) is not DecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (
            type(attn) is Attention
            and type(mlp) is GatedMLP
            and mlp.fused
            and not mlp.gelu
            and attn.q_norm is None
            and not attn.logits_soft_cap
            and attn.rotary is rotary
            and (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
            == (first.num_heads, first.num_kv_heads, first.head_dim, first.scale)
            and all(
                type(n) is RMSNorm and n.fused and not n.unit_offset and n.eps == eps for n in norms
            )
        ):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(lin) is PackedStackedLinear for lin in linears):
            return None
        params += [norms[0].weight, norms[1].weight]
        for linear in linears:
            entry = _linear_entry(linear)
            if entry is None:
                return None
            tensors, numbers = entry
            params += tensors
            ints += numbers
        ints.append(attn.sliding_window or 0)
    if not (rotary.fused and rotary.rotary_dim == rotary.head_dim):
        return None
    half = rotary.cos.shape[1] // 2
    tables = (rotary.cos[:, :half].float().contiguous(), rotary.sin[:, :half].float().contiguous())
    config = {
        "scale": first.scale,
        "eps": eps,
        "shape": (first.num_heads, first.num_kv_heads, first.head_dim),
    }
    return FusedDecoderStack(params, ints, tables, config)


def _linear_entry(linear: Any) -> tuple[list[torch.Tensor], list[int]] | None:
    """(a, b, c, bias) and (kind, group, N) of a PackedStackedLinear (decoder.cpp's layout)."""
    weight = linear.weight
    bias = linear.bias if linear.bias is not None else _EMPTY
    if isinstance(weight, TiledWeight):
        mins = weight.mins if weight.mins is not None else _EMPTY
        numbers = [_KINDS[weight.kind], weight.group, weight.shape[0]]
        return [weight.tiles, weight.scales, mins, bias], numbers
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16:
        return [weight, _EMPTY, _EMPTY, bias], [_KINDS["bf16"], 0, weight.shape[0]]
    return None
