"""One data-parallel replica: an AsyncEngine inside a Ray actor.

The actor is an async actor; `generate` is an async generator that the client calls with
`num_returns="streaming"`, so outputs flow back as they are made. Each yielded item is a
list of every output ready at that moment (one object per batch, not per token, when the
client falls behind). Failures are yielded as `ReplicaFailure` records, not raised: a
raised error would look like a dead actor to the client, and a dead actor is what makes
the client retry elsewhere.

Ray is imported only by the client (`ray.remote(ReplicaActor)`); this module itself does
not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..async_engine import AsyncEngine, EngineDeadError
from ..config import EngineConfig
from ..engine_request import EngineRequest
from ..metrics import IterationStats, SchedulerStats
from ..outputs import RequestOutput

logger = logging.getLogger(__name__)

_MAX_BUFFERED_STATS = 10_000


@dataclass(slots=True)
class ReplicaFailure:
    """The replica refused or failed one request; kind "dead" says the replica's engine is
    gone (its thread died or it was shut down), so the client replaces the replica and
    retries the request elsewhere, as for an actor that died."""

    kind: str  # "invalid" (ValueError: the caller's fault) | "failed" | "dead"
    message: str


class _StatBuffer:
    """A StatLogger that keeps the replica's per-step stats until the client drains them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[SchedulerStats, IterationStats]] = []

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        with self._lock:
            self._items.append((scheduler, iteration))
            del self._items[:-_MAX_BUFFERED_STATS]

    def drain(self) -> list[tuple[SchedulerStats, IterationStats]]:
        with self._lock:
            items, self._items = self._items, []
        return items


class ReplicaActor:
    """Holds one engine (loaded in the constructor); every method is called through Ray."""

    def __init__(self, config: EngineConfig, index: int):
        self.index = index
        self.engine = AsyncEngine(config)
        self.stats = _StatBuffer()
        self.engine.add_stat_logger(self.stats)

    def info(self) -> dict[str, Any]:
        model = self.engine.model_info
        return {
            "index": self.index,
            "model_name": model.name,
            "max_model_len": model.max_model_len,
            "vocab_size": model.vocab_size,
            "eos_token_ids": list(model.eos_token_ids),
            "block_size": model.block_size,
            "architecture": model.architecture,
            "generation_defaults": dict(model.generation_defaults),
            "num_blocks": self.engine.num_total_blocks(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, request: EngineRequest):
        """Stream lists of RequestOutputs (or one ReplicaFailure) for one request, as the
        driver validated it: the engine builds its state from it as it is (a grammar the
        driver compiled arrives serialized and is not compiled again)."""
        loop = asyncio.get_running_loop()
        # Its arrival here: the driver's monotonic clock may be another machine's.
        request = request.replace(arrival_time=time.monotonic())
        request_id = request.request_id
        try:
            stream = self.engine.submit(request, loop=loop)
        except ValueError as error:
            yield [ReplicaFailure("invalid", str(error))]
            return
        except EngineDeadError as error:
            yield [ReplicaFailure("dead", str(error))]
            return
        ready: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for output in stream:
                    ready.put_nowait(output)
            except EngineDeadError as error:  # the engine is gone, not only this request
                ready.put_nowait(ReplicaFailure("dead", str(error)))
            except Exception as error:  # RequestError: the engine failed this request
                ready.put_nowait(ReplicaFailure("failed", f"{type(error).__name__}: {error}"))
            ready.put_nowait(None)

        task = loop.create_task(pump())
        try:
            while True:
                batch = [await ready.get()]
                while not ready.empty():
                    batch.append(ready.get_nowait())
                done = batch[-1] is None
                items: list[RequestOutput | ReplicaFailure] = [b for b in batch if b is not None]
                if items:
                    yield items
                if done:
                    return
        finally:
            if not stream.finished:  # the client went away: free the blocks
                self.engine.abort(request_id)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def health(self, stall_after: float) -> tuple[bool, str | None]:
        """(whether the engine still runs, what is wrong with it or None): flags only, see
        `EngineClient.health`."""
        return self.engine.is_running, self.engine.health(stall_after)

    def counters(self) -> dict[str, Any]:
        return self.engine.counters.snapshot()

    def grammar_compiles(self) -> int:
        """Constraints this replica compiled itself (requests bring theirs compiled)."""
        return self.engine.grammar_compiles

    # Methods that wait for the engine thread run off the actor's event loop, so that the
    # streams of the other requests keep flowing meanwhile.
    async def scheduler_stats(self) -> SchedulerStats:
        return await asyncio.to_thread(self.engine.scheduler_stats)

    def drain_stats(self) -> list[tuple[SchedulerStats, IterationStats]]:
        return self.stats.drain()

    async def num_free_blocks(self) -> int:
        return await asyncio.to_thread(self.engine.num_free_blocks)

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.to_thread(self.engine.reset_prefix_cache)

    async def save_prefix(self, prompt: Any, cache_salt: str | None = None) -> int:
        return await asyncio.to_thread(self.engine.save_prefix, prompt, cache_salt)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)
