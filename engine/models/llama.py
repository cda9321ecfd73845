"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

The model sees one flat batch per step: `input_ids [T]`, `positions [T]` and an
`AttentionMetadata`; it reads and writes keys and values only through slot mappings and
block tables. Everything it does is the shared `CausalLM` default: pre-norm blocks of
attention (q/k/v stacked, biases as the config says) and a SwiGLU MLP.
"""

from __future__ import annotations

from typing import Any

from .causal_lm import CausalLM
from .config import ModelConfig, common_fields

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# The name the rest of the engine has always used for the config record.
LlamaConfig = ModelConfig


def parse_llama_config(cfg: dict[str, Any]) -> ModelConfig:
    fields = common_fields(cfg)
    is_qwen2 = fields["architecture"] == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    sliding = cfg.get("sliding_window")
    if is_qwen2 and not cfg.get("use_sliding_window", False):
        sliding = None
    fields.update(
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=int(sliding) if sliding else None,
    )
    return ModelConfig(**fields)


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 (rope scaling default, linear, dynamic, llama3), Mistral (sliding window),
    Qwen2 (q/k/v biases), SmolLM2; GQA; tied or separate lm_head."""
