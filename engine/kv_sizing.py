"""How long one sequence may be (`max_model_len`) and how much KV cache the engine holds,
from the settings, the model and the machine.

The defaults follow vLLM's: a sequence may be as long as the model's own context. On a
CPU the KV cache's default budget grows to hold one such sequence (at least 1 GiB, at
most a quarter of the machine's memory); where even that quarter cannot hold the model's
context, the default `max_model_len` is lowered to what it holds and the startup log says
how much memory the full context needs. The cache's pages are untouched until requests
write them (model_runner's `_zeros_on_huge_pages`), so a large budget costs memory only as
it is used. Settings the user gives are honoured as given or refused (`ValueError`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import GiB
from .models.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 * GiB  # the least default KV budget on a CPU
DEFAULT_KV_SHARE_OF_MEMORY = 4  # the default budget grows to at most memory / this


def kv_bytes_per_block(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    world_size: int = 1,
    num_slots: int | None = None,
) -> int:
    """Bytes of keys and values of one block of `block_size` tokens on one rank (each of
    `world_size` tensor-parallel ranks holds 1/world_size of the KV heads). A block is a
    row of `num_slots` layers' tensors (KVLayout.num_slots; default every layer)."""
    element = torch.tensor([], dtype=dtype).element_size()
    heads = cfg.num_kv_heads // world_size
    layers = cfg.num_layers if num_slots is None else num_slots
    return 2 * layers * block_size * heads * cfg.head_dim * element


def machine_memory_bytes() -> int:
    """This machine's physical memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(frozen=True, slots=True)
class ContextFit:
    """The sequence length and CPU KV budget the engine starts with."""

    max_model_len: int
    kv_budget_bytes: int
    note: str = ""  # for the startup log: why max_model_len is below the model's context


def fit_cpu_context(
    max_model_len: int,
    defaulted: bool,
    kv_cache_memory: int | None,
    per_block: int,
    block_size: int,
    memory_bytes: int | None = None,
    disk_blocks: int = 0,
    sequence_blocks: Callable[[int], int] | None = None,
    tokens_held: Callable[[int], int] | None = None,
) -> ContextFit:
    """The KV budget for a CPU engine, and max_model_len lowered to fit it (with the KV
    disk tier's `disk_blocks`) when the user did not set max_model_len (`defaulted`). An
    explicit max_model_len the two cannot hold is left for the block count check to refuse.

    sequence_blocks(n): the blocks one sequence of n tokens holds; tokens_held(b): the
    longest sequence b blocks hold (KVLayout's; default: a block per block_size tokens)."""
    if sequence_blocks is None:
        sequence_blocks = lambda tokens: -(-tokens // block_size)  # noqa: E731
    if tokens_held is None:
        tokens_held = lambda blocks: blocks * block_size  # noqa: E731
    full_sequence = sequence_blocks(max_model_len) * per_block
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    else:
        memory = machine_memory_bytes() if memory_bytes is None else memory_bytes
        ceiling = max(DEFAULT_CPU_KV_BYTES, memory // DEFAULT_KV_SHARE_OF_MEMORY)
        # The disk tier holds what a full sequence needs past the default budget.
        memory_part = max(full_sequence - disk_blocks * per_block, 0)
        budget = min(max(DEFAULT_CPU_KV_BYTES, memory_part), ceiling)
    holds = tokens_held(budget // per_block + disk_blocks)
    if not defaulted or holds >= max_model_len:
        return ContextFit(max_model_len, budget)
    setting = (
        "kv_cache_memory" if kv_cache_memory is not None else "a quarter of this machine's memory"
    )
    if disk_blocks:
        setting += " with kv_disk_space"
    note = (
        f" (the model's context is {max_model_len} tokens, which need "
        f"{full_sequence / GiB:.2f} GiB of KV cache; {setting} holds {holds}: set "
        f"kv_cache_memory={full_sequence} (or kv_disk_space) for the whole context, or "
        "max_model_len)"
    )
    logger.warning("max_model_len lowered to %d%s", holds, note)
    return ContextFit(holds, budget, note)


def check_blocks_hold_a_sequence(
    num_blocks: int, block_size: int, max_model_len: int, min_blocks: int | None = None
) -> None:
    """ValueError when the KV cache cannot hold one sequence of max_model_len (which
    takes `min_blocks`; default one per block_size tokens)."""
    if min_blocks is None:
        min_blocks = -(-max_model_len // block_size)
    if num_blocks < min_blocks:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens but one "
            f"sequence of max_model_len {max_model_len} needs {min_blocks}; raise "
            "kv_cache_memory / gpu_memory_utilization or lower max_model_len"
        )
