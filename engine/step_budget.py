"""How many tokens one engine step may compute (`max_num_batched_tokens`), from the
settings, the device and the kind of model."""

from __future__ import annotations

import torch

from .config import EngineConfig

# An encoder's tokens per step when the user sets none: it runs whole prompts only, so
# room for several of them; the linears reach their rate well before this.
ENCODER_BATCHED_TOKENS = 2048


def default_batched_tokens(device: torch.device) -> int:
    """Tokens per step with chunked prefill when the user sets none. On a CPU, 512: the
    packed linears run as fast at 512 rows as at 2048 (the int8 kernels reach their rate by
    ~256 rows), and a step's activations are a quarter as large (a 64-sequence job's peak
    memory measured 143 MiB lower at 512 than at 2048). On a GPU, 2048."""
    return 2048 if device.type == "cuda" else 512


def step_budget(
    config: EngineConfig, device: torch.device, max_model_len: int, encoder: bool
) -> int:
    """The token budget of a step; ValueError when a prompt could never fit in one where
    it has to (an encoder's prompt always, any prompt without chunked prefill)."""
    if config.max_num_batched_tokens is not None:
        budget = config.max_num_batched_tokens
    elif encoder:
        budget = max(ENCODER_BATCHED_TOKENS, max_model_len)
    else:
        budget = default_batched_tokens(device) if config.enable_chunked_prefill else max_model_len
    if encoder and budget < max_model_len:
        raise ValueError(
            f"an encoder runs each prompt whole in one step: max_num_batched_tokens "
            f"({budget}) must be >= max_model_len ({max_model_len})"
        )
    if not config.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"without chunked prefill, max_num_batched_tokens ({budget}) "
            f"must be >= max_model_len ({max_model_len}) so every prompt fits in a step"
        )
    return budget
