"""What the engine tells its callers about the model it serves (`ModelInfo`), and the forms
a prompt may take (`PromptType`).

The engine step (llm_engine.py, input_processor.py) builds these, so they sit in the core
layer; the boundary (client.py, `EngineClient.model_info`) hands them to the front ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PromptType = str | list[int] | dict[str, Any]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a front end may know about the served model, without touching it."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    # The Hugging Face architecture (Qwen3ForCausalLM, ...): picks the tool-call format when
    # the chat template does not say.
    architecture: str | None = None
    # Sampling defaults from the model's generation_config.json (vLLM's
    # `--generation-config auto`): temperature, top_p, top_k, min_p, repetition_penalty,
    # max_tokens. Explicit settings always win over them.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # What the engine serves: "generate" (text), "embed" (embeddings), or both.
    tasks: tuple[str, ...] = ("generate",)
    embedding_size: int = 0  # the length of a full embedding (the hidden size)
    pooler: Any = None  # engine/pooling.py's PoolerConfig: pooling, normalize, limits
