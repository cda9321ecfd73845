"""The hyperparameters every model family is built from, and the parsing they share.

One record serves all families: the fields that only some families use default to the
Llama behaviour (no q/k norm, no soft-capping, full rotary, no experts), so a family's
parser sets only what its config.json says differently. `ModelConfig.from_hf_dict` picks
the family's parser from the `architectures` entry through `registry.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(slots=True)
class ModelConfig:
    """The fields of a Hugging Face config.json that the forward pass needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    # ---- what only some families use (defaults: the Llama behaviour)
    # Per layer, SLIDING or FULL; None: every layer uses `sliding_window` (which may be None).
    layer_types: list[str] | None = None
    # Rope base and scaling of the sliding layers when they differ from the global ones (Gemma 3).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0  # share of head_dim that is rotated (Phi-4-mini: 0.75)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    hidden_act: str = "silu"  # silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rotary (Qwen3, Gemma 3)
    # RMSNorm weights stored as w - 1, the norm multiplies by (1 + w) in float32 (Gemma).
    rms_norm_unit_offset: bool = False
    # Mixture of experts (Qwen3-MoE): E experts of moe_intermediate_size, top-k per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: list[bool] | None = None  # layer i runs experts (else a dense MLP)
    # Encoders (BERT): bidirectional attention over the whole prompt in one step, no KV
    # cache, no LM head; rms_norm_eps holds their LayerNorm epsilon.
    causal: bool = True
    type_vocab_size: int = 0  # BERT's token-type (segment) embeddings

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a config.json of any supported architecture (ValueError naming the
        supported ones for any other)."""
        from .registry import parse_hf_config

        return parse_hf_config(cfg)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: it sees the whole sequence)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def layer_is_sparse(self, layer: int) -> bool:
        return self.sparse_layers is not None and self.sparse_layers[layer]

    @property
    def attention_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return float(self.head_dim) ** -0.5


def hf_architecture(cfg: dict[str, Any]) -> str:
    architectures = cfg.get("architectures") or []
    return architectures[0] if architectures else str(cfg.get("model_type", "?"))


def rope_settings(cfg: dict[str, Any], layer_type: str | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) from either config format.

    transformers 4.x writes `rope_theta` and `rope_scaling` as two fields; 5.x writes one
    `rope_parameters` dict (keyed by layer type for families whose layer types differ).
    """
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta",)}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def common_fields(cfg: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    """The fields every family reads the same way, as ModelConfig keyword arguments.

    `defaults` fill what a family's config.json may leave out (transformers' class
    defaults for that family); the config file wins where it has the field.
    """
    merged = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
    num_heads = int(merged["num_attention_heads"])
    hidden = int(merged["hidden_size"])
    theta, scaling = rope_settings(merged)
    eos = merged.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return dict(
        architecture=hf_architecture(cfg),
        vocab_size=int(merged["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(merged.get("intermediate_size") or 0),
        num_layers=int(merged["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(merged.get("num_key_value_heads") or num_heads),
        head_dim=int(merged.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(merged.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(merged.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(merged.get("tie_word_embeddings", False)),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        sliding_window=None,
        eos_token_ids=eos_ids,
        bos_token_id=merged.get("bos_token_id"),
        torch_dtype=merged.get("torch_dtype") or merged.get("dtype"),
    )
