"""Which model families pagedllm runs: Hugging Face architecture name -> config parser and
model class. The engine, the tensor-parallel ranks and KV sizing all build models here.

To add a family: write `engine/models/<family>.py` (a `CausalLM` subclass and a parser of
its config.json into a `ModelConfig`), add its architectures below, and, for GGUF files of
it, its tensor table in `engine/gguf_arch.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .backend import Backend
from .bert import (
    BERT_ARCHITECTURES,
    NOMIC_BERT_ARCHITECTURES,
    BertEncoder,
    parse_bert_config,
    parse_nomic_bert_config,
)
from .causal_lm import CausalLM
from .config import ModelConfig, hf_architecture
from .gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextModel,
    parse_gemma2_config,
    parse_gemma3_config,
)
from .llama import LLAMA_ARCHITECTURES, LlamaForCausalLM, parse_llama_config
from .phi3 import Phi3ForCausalLM, parse_phi3_config
from .qwen3 import Qwen3ForCausalLM, parse_qwen3_config
from .qwen3_moe import Qwen3MoeForCausalLM, parse_qwen3_moe_config


@dataclass(frozen=True, slots=True)
class ModelFamily:
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    model_class: type[CausalLM] | type[BertEncoder]


_FAMILIES: dict[str, ModelFamily] = {
    **{arch: ModelFamily(parse_llama_config, LlamaForCausalLM) for arch in LLAMA_ARCHITECTURES},
    "Qwen3ForCausalLM": ModelFamily(parse_qwen3_config, Qwen3ForCausalLM),
    "Qwen3MoeForCausalLM": ModelFamily(parse_qwen3_moe_config, Qwen3MoeForCausalLM),
    "Gemma2ForCausalLM": ModelFamily(parse_gemma2_config, Gemma2ForCausalLM),
    "Gemma3ForCausalLM": ModelFamily(parse_gemma3_config, Gemma3ForCausalLM),
    # Gemma 3 4B-27B checkpoints are multimodal; pagedllm runs their text model.
    "Gemma3ForConditionalGeneration": ModelFamily(
        parse_gemma3_config, Gemma3ForConditionalGeneration
    ),
    # Gemma 3 without its head: EmbeddingGemma (bidirectional, an encoder), or a decoder
    # used as an embedder.
    "Gemma3TextModel": ModelFamily(parse_gemma3_config, Gemma3TextModel),
    "Phi3ForCausalLM": ModelFamily(parse_phi3_config, Phi3ForCausalLM),
    # Encoders: embedding models only (ModelConfig.causal is False).
    **{arch: ModelFamily(parse_bert_config, BertEncoder) for arch in BERT_ARCHITECTURES},
    **{
        arch: ModelFamily(parse_nomic_bert_config, BertEncoder) for arch in NOMIC_BERT_ARCHITECTURES
    },
}


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def _family(architecture: str) -> ModelFamily:
    family = _FAMILIES.get(architecture)
    if family is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; pagedllm runs "
            f"{', '.join(supported_architectures())}"
        )
    return family


def parse_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """A config.json (as a dict) -> ModelConfig; ValueError for an unsupported architecture."""
    return _family(hf_architecture(cfg)).parse_config(cfg)


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    backend: Backend | None = None,
) -> CausalLM:
    """An unloaded model of cfg's family (weights come through `load_weights`), computing
    on `backend` (backend.py; the torch reference with dense linears by default)."""
    model_class = _family(cfg.architecture).model_class
    # An encoder family builds a BertEncoder, which the engine drives through the same calls.
    return model_class(cfg, dtype, device, max_model_len, backend=backend)  # type: ignore[return-value]
