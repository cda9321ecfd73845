"""The engine behind a thread: feed it from any thread or event loop, read streams back.

One engine thread owns the `LLMEngine` and every piece of mutable engine state. Callers
talk to it only through queues: commands in (`add`, `abort`, `stop`), outputs out through
one `RequestStream` per request. An asyncio caller's stream is fed with
`loop.call_soon_threadsafe`, so the event loop never blocks on the engine.

This is what turns twenty concurrent LangChain calls into one batch.

The thread ends after `IDLE_EXIT_SECONDS` without work and a new one starts with the next
command. An idle engine must cost the application nothing, and a parked thread does not:
torch's OpenMP runtime (libgomp) keeps a worker pool for every thread that ran a parallel
op, and once the process holds more pool threads than CPUs every parallel region in every
thread stops spinning and sleeps between regions. Measured on 2 cores: small torch ops in
the caller's thread (an embedding model, transformers) ran 3-5x slower while an idle
engine thread kept its pool, and at full speed again once that thread had ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from . import cpu_share
from .client import DEFAULT_STALL_SECONDS, EngineClient
from .config import EngineConfig
from .engine_request import EngineRequest
from .heap import release_freed_memory
from .llm_engine import LLMEngine
from .metrics import SchedulerStats
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

IDLE_EXIT_SECONDS = 0.5
# This many failed steps in a row (each failing every request in it) and `health` says so.
FAILED_STEPS_UNHEALTHY = 3


class EngineDeadError(RuntimeError):
    """The engine was shut down (or its thread died) while the request was in flight."""


class RequestError(RuntimeError):
    """The engine failed this request (and only this one); the message says why."""


class RequestStream:
    """The outputs of one request, as a blocking iterator or an async iterator."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ):
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._sync_queue: queue.Queue = sink if sink is not None else queue.Queue()
        self._async_queue: asyncio.Queue | None = asyncio.Queue() if loop is not None else None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread only."""
        if self._async_queue is not None and self._loop is not None:
            # A closed caller loop raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
        else:
            self._sync_queue.put(item)

    def _check(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error is not None:
                raise RequestError(f"request {item.request_id} failed: {item.error}")
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self._check(self._sync_queue.get())

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async_queue is not None, "stream was created without an event loop"
        while not self.finished:
            yield self._check(await self._async_queue.get())

    def result(self) -> RequestOutput:
        """Block until the request ends; its final output."""
        outputs = list(self)
        assert outputs, "a stream always ends with a final output"
        return outputs[-1]


class AsyncEngine(EngineClient):
    """Thread-safe front of one `LLMEngine` (an `EngineClient`); construction loads the model.

    `shutdown()` (or leaving a `with` block) ends the engine thread and releases the
    weights and the KV cache; the tokenizer and `model_info` stay readable.
    """

    def __init__(self, config: EngineConfig | None = None, **engine_args: Any):
        self.config = config if config is not None else EngineConfig.from_kwargs(**engine_args)
        self.engine: LLMEngine = _load_off_thread(self.config)
        # What front ends read, kept apart from the engine so it outlives shutdown().
        self._inputs = self.engine.inputs
        self._counters = self.engine.counters
        self._num_blocks = self.engine.num_blocks
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._dead = False  # the thread raised: nothing restarts it
        self._thread: threading.Thread | None = None  # None while parked (no work)
        # Progress, for `health` (written by the engine thread, read by anyone, no lock):
        # when the thread last went round its loop, and since when its current step runs.
        self._beat = time.monotonic()
        self._step_started: float | None = None
        self._failed_steps = 0  # steps in a row that raised out of LLMEngine.step

    # ------------------------------------------------------------------ state
    @property
    def counters(self):
        return self._counters

    @property
    def is_running(self) -> bool:
        """True while the engine thread serves requests (not shut down, not dead)."""
        return not (self._stopped or self._dead)

    def health(self, stall_after: float = DEFAULT_STALL_SECONDS) -> str | None:
        """None while the engine makes progress; else why it does not: shut down or its
        thread died, a step running for more than `stall_after` seconds, the last
        FAILED_STEPS_UNHEALTHY steps all failed, or requests waiting while the thread has
        not moved for `stall_after` seconds. Reads flags only: cheap from any thread."""
        if self._stopped or self._dead:
            return "the engine is not running"
        now = time.monotonic()
        started = self._step_started
        if started is not None and now - started > stall_after:
            return f"an engine step has been running for {now - started:.0f} s"
        engine = self.engine
        failed = max(self._failed_steps, engine.consecutive_failed_steps if engine else 0)
        if failed >= FAILED_STEPS_UNHEALTHY:
            return f"the last {failed} engine steps failed"
        if self._streams and now - self._beat > stall_after:
            return f"requests are waiting but the engine has not moved for {now - self._beat:.0f} s"
        return None

    def add_stat_logger(self, stat_logger) -> None:
        """Register a StatLogger; it is called on the engine thread after every step."""
        self._send("call", lambda: self.engine.stat_loggers.append(stat_logger))

    def remove_stat_logger(self, stat_logger) -> None:
        """Unregister a StatLogger (a no-op if it is not registered)."""

        def remove() -> None:
            if stat_logger in self.engine.stat_loggers:
                self.engine.stat_loggers.remove(stat_logger)

        self._send("call", remove)

    # ---------------------------------------------------------------- requests
    def submit(
        self,
        request: EngineRequest,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> RequestStream:
        """Submit a request already made by `process_inputs` (validated, tokenized)."""
        return self.submit_many([request], loop=loop, sink=sink)[0]

    def submit_many(
        self,
        requests: list[EngineRequest],
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> list[RequestStream]:
        """Submit requests together: the engine adds every one of them before its next step,
        so the scheduler sees the whole batch at once (priorities hold from the first step)."""
        streams = [RequestStream(r.request_id, loop=loop, sink=sink) for r in requests]
        with self._lock:
            if self._stopped or self._dead:
                raise EngineDeadError("the engine has been shut down or its thread died")
            seen: set[str] = set()  # a set: LLM.generate may hand over thousands at once
            for request in requests:
                if request.request_id in self._streams or request.request_id in seen:
                    raise ValueError(f"request id {request.request_id!r} is already in flight")
                seen.add(request.request_id)
            for stream in streams:
                self._streams[stream.request_id] = stream
        self._send("add", requests)
        return streams

    def abort(self, request_id: str) -> None:
        """End a request from any thread; its stream gets a final output (finish_reason 'abort')."""
        self._send("abort", request_id)

    def call(self, fn):
        """Run fn() on the engine thread and return its result (for stats, cache resets)."""
        done: queue.Queue = queue.Queue()
        self._send("call", lambda: done.put(fn()))
        return done.get()

    def reset_prefix_cache(self) -> bool:
        return self.call(self.engine.reset_prefix_cache)

    def save_prefix(self, prompt, cache_salt: str | None = None) -> int:
        """See `EngineClient.save_prefix`: the prompt runs as a one-token request, and its
        blocks are copied out right after the step that computes it."""
        if self.config.prefix_cache_dir is None:
            raise ValueError("save_prefix needs a prefix-cache directory: set prefix_cache_dir")
        params = SamplingParams(
            temperature=0, max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY
        )
        request = self.process_inputs(prompt, params, cache_salt=cache_salt)
        saved = self.call(lambda: self.engine.save_prefix(request.request_id))
        output = self.submit(request).result()
        if output.outputs[0].finish_reason == "abort":
            return 0
        return saved.result()

    def scheduler_stats(self) -> SchedulerStats:
        """A snapshot of the scheduler's gauges, taken on the engine thread."""
        return self.call(self.engine.scheduler_stats)

    def num_free_blocks(self) -> int:
        return self.call(lambda: self.engine.kv_manager.pool.num_free_blocks)

    def num_total_blocks(self) -> int:
        return self._num_blocks

    def shutdown(self) -> None:
        """Stop the engine thread, fail what is in flight, and release the weights and the
        KV cache (their memory is returned once this returns). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._commands.put(("stop", None))
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
        else:  # parked: nobody is left to fail the streams
            self._fail_all(EngineDeadError("the engine has been shut down"))
        cpu_share.mark_generating(self, False)
        engine, self.engine = self.engine, None  # type: ignore[assignment]
        if engine is not None:
            engine.shutdown()
            del engine
            release_freed_memory()

    # ------------------------------------------------------------- the thread
    def _send(self, kind: str, payload: Any) -> None:
        """Queue a command for the engine thread, starting the thread if it is parked."""
        with self._lock:
            if self._stopped:
                if kind == "abort":  # a stream ending after shutdown: nothing left to abort
                    return
                raise EngineDeadError("the engine has been shut down")
            self._commands.put((kind, payload))
            if self._thread is None and not self._dead:
                self._thread = threading.Thread(
                    target=self._run, name="pagedllm-engine", daemon=True
                )
                self._thread.start()

    def _park(self) -> bool:
        """End the thread if no command came in meanwhile (under the lock `_send` takes)."""
        cpu_share.mark_generating(self, False)
        with self._lock:
            if not self._commands.empty():
                return False
            self._thread = None
            return True

    def _run(self) -> None:
        try:
            self.engine.executor.claim_thread()
            while True:
                self._beat = time.monotonic()
                idle = not self.engine.has_unfinished_requests()
                keep_going = self._drain_commands(block=idle)
                self._beat = time.monotonic()
                if keep_going is None:
                    if self._park():
                        return
                    continue
                if not keep_going:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # the thread must never die silently
            logger.exception("engine thread died")
            self._dead = True
            self._fail_all(EngineDeadError(f"engine thread died: {error}"))
            raise
        self._fail_all(EngineDeadError("the engine has been shut down"))

    def _drain_commands(self, block: bool) -> bool | None:
        """Apply queued commands; False once asked to stop, None after IDLE_EXIT_SECONDS
        of waiting (when blocking) with nothing to do."""
        try:
            command = self._commands.get(block=block, timeout=IDLE_EXIT_SECONDS if block else None)
        except queue.Empty:
            return None if block else True
        while True:
            kind, payload = command
            if kind == "stop":
                return False
            if kind == "add":
                for request in payload:
                    self._add(request)
            elif kind == "abort":
                output = self.engine.abort_request(payload)
                if output is not None:
                    self._deliver(output)
            elif kind == "call":
                payload()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except Exception as error:
            stream = self._pop_stream(request.request_id)
            if stream is not None:
                stream.put(error)

    def _step(self) -> None:
        self._step_started = started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as error:  # a broken invariant: fail what is in flight, keep serving
            self._step_started = None
            self._failed_steps += 1
            logger.exception("engine step raised; aborting every request in flight")
            for request_id in list(self.engine.groups):
                self.engine.abort_request(request_id)
                stream = self._pop_stream(request_id)
                if stream is not None:
                    stream.put(RuntimeError(f"engine step failed: {error}"))
            return
        self._step_started = None
        self._failed_steps = 0
        for output in outputs:
            self._deliver(output)
        self._share_cpu(time.monotonic() - started)

    def _share_cpu(self, step_seconds: float) -> None:
        """A generation engine says whether it is busy; an embedding-only engine pauses
        while one is (engine/cpu_share.py)."""
        if "generate" in self._inputs.info.tasks:
            cpu_share.mark_generating(self, self.engine.has_unfinished_requests())
        elif self.engine.has_unfinished_requests():
            pause = cpu_share.pause_after(step_seconds, self.config.embedding_cpu_share)
            if pause > 0:
                time.sleep(pause)

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished:
            stream = self._pop_stream(output.request_id)
        else:
            with self._lock:
                stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)

    def _pop_stream(self, request_id: str) -> RequestStream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.put(error)


def _load_off_thread(config: EngineConfig) -> LLMEngine:
    """Build the LLMEngine in a short-lived thread and wait for it (errors re-raised here).

    Loading runs parallel torch ops; done in the caller's thread, it would leave that
    thread an OpenMP pool for good, and two pools on a small machine throttle each other
    (see the module docstring). A server's or an app's main thread then keeps none.
    """
    result: list[LLMEngine] = []
    failure: list[BaseException] = []

    def load() -> None:
        try:
            result.append(LLMEngine(config))
        except BaseException as error:  # handed to the caller
            failure.append(error)

    loader = threading.Thread(target=load, name="pagedllm-load")
    loader.start()
    loader.join()
    if failure:
        raise failure[0]
    # Loading frees its temporaries (dequantized and unpacked weights, the tokenizer's
    # parse) into the loader thread's arena, where the pages stay resident and count in
    # every later peak; handing them back costs one malloc_trim (13 MiB for the default
    # model; the engine's steps reuse that arena and fault in only what they need).
    release_freed_memory()
    return result[0]


def __getattr__(name: str) -> Any:
    # The factory moved to engine/factory.py; old imports keep working.
    if name in ("create_engine", "shared_engine", "shutdown_shared_engines"):
        from . import factory

        return getattr(factory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
