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
            }


class LoggingStatLogger:
    """One INFO line every `interval` seconds while the engine is busy."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt = 0
        self._generation = 0

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self._prompt += iteration.num_prompt_tokens
        self._generation += iteration.num_generation_tokens
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed < self.interval:
            return
        hit_rate = scheduler.prefix_cache_hits / max(scheduler.prefix_cache_queries, 1)
        logger.info(
            "running %d, waiting %d | prompt %.1f tok/s, generation %.1f tok/s | "
            "KV cache %.1f%% | prefix hits %.1f%% | preemptions %d",
            scheduler.num_running,
            scheduler.num_waiting,
            self._prompt / elapsed,
            self._generation / elapsed,
            100 * scheduler.kv_cache_usage,
            100 * hit_rate,
            scheduler.num_preemptions,
        )
        self._last, self._prompt, self._generation = now, 0, 0
