"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k norm) with a sparse
mixture-of-experts MLP (`moe.py`) in the layers that have one, a dense MLP in the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention import Attention
from .causal_lm import CausalLM, DecoderLayer
from .config import ModelConfig, common_fields
from .layers import GatedMLP
from .moe import SparseMoE
from .qwen3 import QWEN3_DEFAULTS, qwen3_layer_types
from .rotary import RotaryEmbedding

# transformers' Qwen3MoeConfig defaults, for fields a config.json leaves out.
QWEN3_MOE_DEFAULTS: dict[str, Any] = dict(
    QWEN3_DEFAULTS,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    decoder_sparse_step=1,
    norm_topk_prob=False,
)


def parse_qwen3_moe_config(cfg: dict[str, Any]) -> ModelConfig:
    fields = common_fields(cfg, **QWEN3_MOE_DEFAULTS)
    merged = {**QWEN3_MOE_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    num_layers = fields["num_layers"]
    # transformers 5 writes the expert count as num_local_experts; 4.x and the Hub as num_experts.
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) or int(
        QWEN3_MOE_DEFAULTS["num_experts"]
    )
    step = int(merged["decoder_sparse_step"])
    dense_only = set(merged.get("mlp_only_layers") or [])
    sparse = [i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)]
    window, types = qwen3_layer_types(cfg, num_layers)
    attention_bias = bool(cfg.get("attention_bias", False))
    fields.update(
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        sliding_window=window,
        layer_types=types,
        qk_norm=True,
        hidden_act=str(merged.get("hidden_act", "silu")),
        num_experts=num_experts,
        num_experts_per_tok=int(merged["num_experts_per_tok"]),
        moe_intermediate_size=int(merged["moe_intermediate_size"]),
        norm_topk_prob=bool(merged["norm_topk_prob"]),
        sparse_layers=sparse,
    )
    return ModelConfig(**fields)


class Qwen3MoeForCausalLM(CausalLM):
    def make_layer(
        self,
        cfg: ModelConfig,
        index: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        prefix = f"model.layers.{index}"
        fused = self.fused_cpu
        attn = Attention(
            cfg, index, f"{prefix}.self_attn", self.make_linear, rotary, dtype, device, fused
        )
        mlp: nn.Module
        if cfg.layer_is_sparse(index):
            mlp = SparseMoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                cfg.hidden_act,
                f"{prefix}.mlp",
                self.make_linear,
                dtype,
                device,
                fused,
            )
        else:
            mlp = GatedMLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                False,
                cfg.hidden_act,
                f"{prefix}.mlp",
                self.make_linear,
                dtype,
                device,
                fused,
            )
        return DecoderLayer(attn, mlp, cfg, dtype, device, fused)
