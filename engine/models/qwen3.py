"""Qwen3 (0.6B-32B): the Llama block with an RMSNorm over head_dim on q and k (before
rotary), an explicit head_dim (not hidden / heads), and no q/k/v biases.
"""

from __future__ import annotations

from typing import Any

from .causal_lm import CausalLM
from .config import FULL, SLIDING, ModelConfig, common_fields

# transformers' Qwen3Config defaults, for fields a config.json leaves out.
QWEN3_DEFAULTS: dict[str, Any] = dict(
    head_dim=128,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    sliding_window=4096,
    max_window_layers=28,
)


def qwen3_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, list[str] | None]:
    """(sliding window, per-layer types): windows only with use_sliding_window, and then on
    the layers from max_window_layers on (what transformers' Qwen3 config derives)."""
    if not cfg.get("use_sliding_window", False):
        return None, None
    window = int(cfg.get("sliding_window") or QWEN3_DEFAULTS["sliding_window"])
    types = cfg.get("layer_types")
    if not types:
        first = int(cfg.get("max_window_layers", QWEN3_DEFAULTS["max_window_layers"]))
        types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    return window, list(types)


def parse_qwen3_config(cfg: dict[str, Any]) -> ModelConfig:
    fields = common_fields(cfg, **QWEN3_DEFAULTS)
    window, types = qwen3_layer_types(cfg, fields["num_layers"])
    attention_bias = bool(cfg.get("attention_bias", False))
    fields.update(
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        sliding_window=window,
        layer_types=types,
        qk_norm=True,
        hidden_act=str(cfg.get("hidden_act", "silu")),
    )
    return ModelConfig(**fields)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: the shared pre-norm block; the q/k norm comes with `cfg.qk_norm`."""
