"""Gemma 2 and Gemma 3 (text) over the paged KV cache.

What differs from the Llama block, all of it in this file or in config switches:
- embeddings scaled by sqrt(hidden) (rounded to the model dtype);
- RMSNorm weights stored as w - 1, applied as (1 + w) in float32;
- four norms per block: input and post-attention around attention, pre- and
  post-feedforward around the MLP (the post norms apply before the residual add);
- GeGLU MLP (gelu, tanh approximation);
- attention scale query_pre_attn_scalar^-1/2, not head_dim^-1/2;
- sliding-window layers alternating with global ones (Gemma 2: every other layer;
  Gemma 3: five local to one global), Gemma 3's local layers with their own rope base;
- Gemma 2: attention-logit and final-logit soft-capping, cap * tanh(x / cap);
- Gemma 3: RMSNorm (1 + w) over head_dim on q and k.

KV cache: a sliding layer reads only keys in its window; the engine's default KV layout
(engine/kv_layout.py) gives the sliding layers block tables of their own and frees what
their window has left, so at 32k tokens Gemma 3's five local layers of six hold about
their window, not the whole sequence. Nothing here depends on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention import Attention
from .backend import Backend
from .causal_lm import CausalLM
from .config import FULL, SLIDING, ModelConfig, common_fields, rope_settings
from .layers import GatedMLP, RMSNorm
from .rotary import RotaryEmbedding

# transformers' Gemma2Config / Gemma3TextConfig defaults, for fields a config.json leaves out.
_GEMMA_COMMON: dict[str, Any] = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
)
GEMMA2_DEFAULTS: dict[str, Any] = dict(
    _GEMMA_COMMON, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0
)
GEMMA3_DEFAULTS: dict[str, Any] = dict(
    _GEMMA_COMMON, vocab_size=262208, max_position_embeddings=131072, rope_theta=1_000_000.0
)


def _gemma_fields(cfg: dict[str, Any], defaults: dict[str, Any], architecture: str) -> dict:
    fields = common_fields(cfg, **defaults)
    attention_bias = bool(cfg.get("attention_bias", False))
    fields.update(
        architecture=architecture,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        sliding_window=int(cfg.get("sliding_window") or 4096),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        hidden_act=str(
            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        ),
        rms_norm_unit_offset=True,
    )
    return fields


def _layer_types(cfg: dict[str, Any], num_layers: int, pattern: int) -> list[str]:
    """Every `pattern`-th layer global, the others sliding (unless the config lists them)."""
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must be {num_layers} of {SLIDING!r}/{FULL!r}")
        return list(types)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def parse_gemma2_config(cfg: dict[str, Any]) -> ModelConfig:
    fields = _gemma_fields(cfg, GEMMA2_DEFAULTS, "Gemma2ForCausalLM")
    fields.update(
        layer_types=_layer_types(cfg, fields["num_layers"], 2),
        # An absent key means transformers' default; an explicit null turns capping off.
        attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping", 50.0)),
        final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping", 30.0)),
    )
    return ModelConfig(**fields)


def parse_gemma3_config(cfg: dict[str, Any]) -> ModelConfig:
    """Gemma3ForCausalLM (1B, 270M), the text model of Gemma3ForConditionalGeneration
    (4B-27B: its config nests the text model's fields under `text_config`), or
    Gemma3TextModel (EmbeddingGemma: `use_bidirectional_attention`, an encoder)."""
    architecture = (cfg.get("architectures") or ["Gemma3ForCausalLM"])[0]
    text = dict(cfg.get("text_config") or cfg)
    if "eos_token_id" not in text and "eos_token_id" in cfg:
        text["eos_token_id"] = cfg["eos_token_id"]
    fields = _gemma_fields(text, GEMMA3_DEFAULTS, architecture)
    num_layers = fields["num_layers"]
    pattern = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or 6)
    if isinstance(text.get("rope_parameters"), dict) and FULL in text["rope_parameters"]:
        global_theta, global_scaling = rope_settings(text, FULL)
        local_theta, local_scaling = rope_settings(text, SLIDING)
    else:  # transformers 4.x: rope_theta/rope_scaling are the global layers', plus a local base
        global_theta, global_scaling = rope_settings({**GEMMA3_DEFAULTS, **text})
        local_theta, local_scaling = float(text.get("rope_local_base_freq", 10000.0)), None
    fields.update(
        layer_types=_layer_types(text, num_layers, pattern),
        rope_theta=global_theta,
        rope_scaling=global_scaling,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        qk_norm=True,
        attn_logit_softcap=_optional_float(text.get("attn_logit_softcapping")),
        final_logit_softcap=_optional_float(text.get("final_logit_softcapping")),
        tie_word_embeddings=bool(
            text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        ),
        causal=not text.get("use_bidirectional_attention", False),
    )
    if architecture == "Gemma3TextModel":  # no LM head in the checkpoint: Gemma's tied one
        fields["tie_word_embeddings"] = True
    return ModelConfig(**fields)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(
        self, attn: Attention, mlp: GatedMLP, cfg: ModelConfig, dtype, device, fused: bool
    ):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, True, fused)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, x, kv_cache, meta, residual):
        """(x, residual) -> (this layer's normed MLP output, the residual stream before it):
        the (sub-layer output, residual) protocol of causal_lm.DecoderLayer."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class _Gemma(CausalLM):
    family_features = frozenset({"sandwich_norms"})

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        backend: Backend | None = None,
    ):
        super().__init__(cfg, dtype, device, max_model_len, backend, cfg.hidden_size**0.5)

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
        return GemmaDecoderLayer(attn, mlp, cfg, dtype, device, fused)


class Gemma2ForCausalLM(_Gemma):
    """Gemma 2 (2B, 9B, 27B)."""


class Gemma3ForCausalLM(_Gemma):
    """Gemma 3 text models (270M, 1B)."""


class Gemma3TextModel(_Gemma):
    """A Gemma 3 text model without its LM head, as embedding checkpoints hold it
    (EmbeddingGemma): tensors named without the `model.` prefix."""

    def checkpoint_name(self, name: str) -> str | None:
        if not name.startswith("model."):
            name = "model." + name
        return super().checkpoint_name(name)


class Gemma3ForConditionalGeneration(_Gemma):
    """The text model of Gemma 3 4B-27B checkpoints; the vision tower and projector are skipped."""

    def checkpoint_name(self, name: str) -> str | None:
        if "vision_tower" in name or "multi_modal_projector" in name:
            return None
        for old, new in (
            ("language_model.model.", "model."),  # transformers < 4.52 layout
            ("model.language_model.", "model."),  # transformers >= 4.52 layout
            ("language_model.lm_head.", "lm_head."),
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        return super().checkpoint_name(name)
