"""What the engine tells its callers about the model it serves (`ModelInfo`), and the forms
a prompt may take (`PromptType`).

The engine step (llm_engine.py, input_processor.py) builds these, so they sit in the core
layer; the boundary (client.py, `EngineClient.model_info`) hands them to the front ends.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def prompt_text_or_ids(prompt: PromptType, noun: str = "prompt") -> str | list[int]:
    """A prompt as its text or its token ids (a dict gives its `prompt_token_ids`, else
    its `prompt`); ValueError for any other form. `noun` names it in the message."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError(f"a dict {noun} needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    article = "an" if noun[0] in "aeiou" else "a"
    raise ValueError(
        f"{article} {noun} must be a string, a list of token ids or a dict, "
        f"got {type(prompt).__name__}"
    )


def check_in_vocabulary(token_ids: Sequence[int], vocab_size: int, what: str = "token ids") -> None:
    """ValueError naming the first ids outside 0..vocab_size - 1 (they would index past
    the embedding table or the logits row inside a step, and fail every request in it)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
