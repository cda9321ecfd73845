"""Engine statistics: what `/metrics` exports and what the periodic log line shows.

The engine thread fills one `IterationStats` per step and hands it, with a
`SchedulerStats` snapshot, to every registered `StatLogger`. Loggers must be quick and
must not touch engine state: they run on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger("pagedllm_integrations.engine")


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found
    num_preemptions: int = 0  # cumulative
    # Slots of the running requests' blocks, and how many of them hold a computed token:
    # the difference is paged attention's only waste (each sequence's last partial block).
    kv_tokens_held: int = 0
    kv_slots_reserved: int = 0
    # With prefix_cache_dir: cumulative tokens whose blocks were read from / written to disk.
    prefix_cache_disk_loaded: int = 0
    prefix_cache_disk_written: int = 0
    # Swap space (engine/swap_space.py): blocks of swapped-out requests in each tier now,
    # cumulative blocks copied out of and back into the KV cache, and disk blocks read
    # ahead of their request's resumption.
    swapped_blocks_host: int = 0
    swapped_blocks_disk: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    blocks_swap_read_ahead: int = 0
    # KV disk tier (engine/kv_disk_tier.py): its blocks held by requests now, and
    # cumulative blocks handed out from it (spilled past memory) and read by steps, and
    # cached memory blocks moved into it rather than dropped from the prefix cache.
    kv_disk_blocks: int = 0
    kv_disk_blocks_taken: int = 0
    kv_disk_block_reads: int = 0
    kv_disk_blocks_demoted: int = 0


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float


@dataclass(slots=True)
class IterationStats:
    num_prompt_tokens: int = 0  # prompts whose first token came out in this step
    num_generation_tokens: int = 0
    num_batched_tokens: int = 0  # tokens in the forward pass
    num_seqs: int = 0  # sequences in the forward pass
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec: SpecDecodingStats | None = None  # when sequences verified draft tokens

    def record_drafts(self, num_draft_tokens: list[int], num_accepted: list[int]) -> None:
        """Speculative decoding: per verifying sequence, its drafts and how many were kept."""
        if self.spec is None:
            self.spec = SpecDecodingStats()
        self.spec.observe(num_draft_tokens, num_accepted)


@dataclass(slots=True)
class SpecDecodingStats:
    """Draft tokens proposed and accepted (over a step, or summed over many).

    Position j counts the sequences that had a (j+1)-th draft token, and those whose
    (j+1)-th draft was accepted: acceptance rate per position = accepted / drafted there.
    """

    num_drafts: int = 0  # sequences that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_tokens_per_position: list[int] = field(default_factory=list)
    accepted_tokens_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: list[int], num_accepted: list[int]) -> None:
        for drafted, accepted in zip(num_draft_tokens, num_accepted):
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            _add_ones(self.draft_tokens_per_position, drafted)
            _add_ones(self.accepted_tokens_per_position, accepted)
        _pad(self.accepted_tokens_per_position, len(self.draft_tokens_per_position))

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in (
            (self.draft_tokens_per_position, other.draft_tokens_per_position),
            (self.accepted_tokens_per_position, other.accepted_tokens_per_position),
        ):
            _pad(mine, len(theirs))
            for j, value in enumerate(theirs):
                mine[j] += value
        _pad(self.accepted_tokens_per_position, len(self.draft_tokens_per_position))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(
                self.accepted_tokens_per_position, self.draft_tokens_per_position
            )
        ]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying sequence gets per step: its accepted drafts plus one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @classmethod
    def from_dict(cls, snapshot: dict) -> SpecDecodingStats:
        """The totals back from an `as_dict()` (or an `EngineCounters.snapshot()`)."""
        return cls(
            num_drafts=snapshot.get("spec_decode_num_drafts", 0),
            num_draft_tokens=snapshot.get("spec_decode_num_draft_tokens", 0),
            num_accepted_tokens=snapshot.get("spec_decode_num_accepted_tokens", 0),
            draft_tokens_per_position=list(
                snapshot.get("spec_decode_draft_tokens_per_position", [])
            ),
            accepted_tokens_per_position=list(
                snapshot.get("spec_decode_accepted_tokens_per_position", [])
            ),
        )

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
            "spec_decode_draft_tokens_per_position": list(self.draft_tokens_per_position),
            "spec_decode_accepted_tokens_per_position": list(self.accepted_tokens_per_position),
            "spec_decode_acceptance_rate_per_position": self.acceptance_rate_per_position,
        }


def _add_ones(counts: list[int], length: int) -> None:
    """counts[j] += 1 for j < length, growing counts as needed."""
    _pad(counts, length)
    for j in range(length):
        counts[j] += 1


def _pad(counts: list[int], length: int) -> None:
    if len(counts) < length:
        counts.extend([0] * (length - len(counts)))


class StatLogger(Protocol):
    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None: ...


class EngineCounters:
    """Cumulative totals since the engine started (thread-safe snapshot for tests and tools)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished = 0
        self.max_seqs_in_step = 0
        self.batch_sizes: list[int] = []  # sequences per step, the last 10,000 steps
        self.last_scheduler = SchedulerStats()
        self.spec = SpecDecodingStats()  # speculative decoding since start

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        with self._lock:
            self.steps += 1
            self.prompt_tokens += iteration.num_prompt_tokens
            self.generation_tokens += iteration.num_generation_tokens
            self.requests_finished += len(iteration.finished)
            self.max_seqs_in_step = max(self.max_seqs_in_step, iteration.num_seqs)
            self.batch_sizes.append(iteration.num_seqs)
            del self.batch_sizes[:-10_000]
            self.last_scheduler = scheduler
            if iteration.spec is not None:
                self.spec.add(iteration.spec)

    def snapshot(self) -> dict:
        with self._lock:
            s = self.last_scheduler
            return {
                "steps": self.steps,
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "requests_finished": self.requests_finished,
                "max_seqs_in_step": self.max_seqs_in_step,
                "num_running": s.num_running,
                "num_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage,
                "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits,
                "num_preemptions": s.num_preemptions,
                "prefix_cache_disk_loaded": s.prefix_cache_disk_loaded,
                "prefix_cache_disk_written": s.prefix_cache_disk_written,
                "swapped_blocks_host": s.swapped_blocks_host,
                "swapped_blocks_disk": s.swapped_blocks_disk,
                "blocks_swapped_out": s.blocks_swapped_out,
                "blocks_swapped_in": s.blocks_swapped_in,
                "blocks_swap_read_ahead": s.blocks_swap_read_ahead,
                "kv_disk_blocks": s.kv_disk_blocks,
                "kv_disk_blocks_taken": s.kv_disk_blocks_taken,
                "kv_disk_block_reads": s.kv_disk_block_reads,
                "kv_disk_blocks_demoted": s.kv_disk_blocks_demoted,
                **self.spec.as_dict(),
            }


class LoggingStatLogger:
    """One INFO line every `interval` seconds while the engine is busy."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt = 0
        self._generation = 0
        self._spec = SpecDecodingStats()

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self._prompt += iteration.num_prompt_tokens
        self._generation += iteration.num_generation_tokens
        if iteration.spec is not None:
            self._spec.add(iteration.spec)
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed < self.interval:
            return
        hit_rate = scheduler.prefix_cache_hits / max(scheduler.prefix_cache_queries, 1)
        spec = ""
        if self._spec.num_drafts:
            spec = (
                f" | drafts accepted {100 * self._spec.acceptance_rate:.1f}% "
                f"({self._spec.mean_acceptance_length:.2f} tokens per verifying step)"
            )
        logger.info(
            "running %d, waiting %d | prompt %.1f tok/s, generation %.1f tok/s | "
            "KV cache %.1f%% | prefix hits %.1f%% | preemptions %d%s",
            scheduler.num_running,
            scheduler.num_waiting,
            self._prompt / elapsed,
            self._generation / elapsed,
            100 * scheduler.kv_cache_usage,
            100 * hit_rate,
            scheduler.num_preemptions,
            spec,
        )
        self._last, self._prompt, self._generation = now, 0, 0
        self._spec = SpecDecodingStats()
