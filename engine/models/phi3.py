"""Phi-3 and Phi-4-mini: the Llama block with fused checkpoint linears (`qkv_proj` holds
q|k|v, `gate_up_proj` holds gate|up, split into the engine's stacked shards as they load),
longrope ("su") rope scaling, and, in Phi-4-mini, rotary over a share of each head
(partial_rotary_factor 0.75).
"""

from __future__ import annotations

from typing import Any

from .causal_lm import CausalLM
from .config import ModelConfig, common_fields

# transformers' Phi3Config defaults, for fields a config.json leaves out.
PHI3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32064,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=32000,
)


def parse_phi3_config(cfg: dict[str, Any]) -> ModelConfig:
    fields = common_fields(cfg, **PHI3_DEFAULTS)
    rope_parameters = cfg.get("rope_parameters") or {}
    partial = float(
        cfg.get("partial_rotary_factor") or rope_parameters.get("partial_rotary_factor") or 1.0
    )
    scaling = fields["rope_scaling"]
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type in ("longrope", "su"):
            original = int(
                scaling.get("original_max_position_embeddings")
                or cfg.get("original_max_position_embeddings")
                or fields["max_position_embeddings"]
            )
            scaling["original_max_position_embeddings"] = original
            if not scaling.get("factor"):
                scaling["factor"] = fields["max_position_embeddings"] / original
    sliding = cfg.get("sliding_window")
    fields.update(
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        sliding_window=int(sliding) if sliding else None,
        hidden_act=str(cfg.get("hidden_act", "silu")),
    )
    return ModelConfig(**fields)


class Phi3ForCausalLM(CausalLM):
    family_features = frozenset({"fused_checkpoint_linears"})
    fused_linears = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
