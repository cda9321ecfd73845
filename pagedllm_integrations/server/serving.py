"""The bridge between HTTP requests and engine requests.

`ServerState` holds what the routes share: the engine, the served name, the metrics and the
admission count behind the 503. `EngineCall` is the group of engine requests behind one HTTP
request (one per prompt of a completions batch) with their outputs merged into one async
iterator.

Why one pump task per engine stream: when the client goes away the call aborts its
requests, and the pumps keep reading until each stream's final (abort) output. Only then are
the sequences released from the admission count and the tokens the aborted requests produced
counted in the metrics — so a disconnect never leaks a slot, and `/metrics` adds up exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from ..engine.async_engine import RequestStream
from ..engine.client import DEFAULT_STALL_SECONDS, EngineClient, PromptType
from ..engine.engine_request import EngineRequest
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.structured_outputs import (
    DEFAULT_COMPILE_TIMEOUT_S,
    CompileCancelledError,
    CompilerUnavailableError,
    compile_limits,
)
from .clients import ClientAdmission, client_identity
from .errors import APIError
from .metrics import PrometheusStatLogger
from .prompt_bound import PromptBound

logger = logging.getLogger(__name__)

T = TypeVar("T")
PREPARE_THREADS = 4  # tokenizing / rendering / compiling requests at once


@dataclass(slots=True)
class ServerLimits:
    """What the server bounds per request, beyond the engine's own checks."""

    compile_timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S  # seconds a constraint may take
    report_cached_tokens: bool = True  # usage.prompt_tokens_details.cached_tokens
    health_stall_timeout: float = DEFAULT_STALL_SECONDS  # a step this long: /health says 503
    allow_unknown_fields: bool = False  # fields no known server defines: ignored, not a 400


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    model_name: str
    metrics: PrometheusStatLogger
    max_queue_len: int | None
    limits: ServerLimits = field(default_factory=ServerLimits)
    # Tokenizing, rendering and grammar compiling run here, never on the event loop; the
    # admission count (max_queue_len) bounds what waits for it.
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            max_workers=PREPARE_THREADS, thread_name_prefix="pagedllm-prepare"
        )
    )
    in_flight: int = 0  # sequences admitted and not yet ended (running + waiting)
    background: set[asyncio.Task] = field(default_factory=set)
    created: int = field(default_factory=lambda: int(time.time()))
    # Shutdown (runner.py): draining refuses new requests; aborting ends the running ones.
    open_calls: set[EngineCall] = field(default_factory=set)
    draining: bool = False
    aborting: bool = False
    prompt_bound: PromptBound = field(init=False)
    # Sequences in flight per client, bounded by max_seqs_per_client (clients.py).
    clients: ClientAdmission = field(default_factory=lambda: ClientAdmission(None))

    def __post_init__(self) -> None:
        self.prompt_bound = PromptBound.for_tokenizer(
            self.engine.tokenizer, self.engine.max_model_len
        )

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           code="shutting_down")  # fmt: skip

    def abort_all(self) -> None:
        """Abort every running request (shutdown): each stream ends with an 'abort'
        output; requests still being prepared are refused when they are ready."""
        self.draining = self.aborting = True
        for call in list(self.open_calls):
            call.close()

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.engine.model_name):
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r} "
                "(see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def off_loop(self, request: Request, work: Callable[[], T]) -> T:
        """Run `work` in the server's pool, within the compile timeout; if the client leaves
        meanwhile, raise ClientGone and drop the work (a queued job never starts, a compile
        it waits for is dropped when nobody else waits for it)."""
        cancelled = threading.Event()
        timeout = self.limits.compile_timeout

        def job() -> T:
            if cancelled.is_set():
                raise CompileCancelledError("the client left before its request was prepared")
            with compile_limits(timeout, cancelled):
                return work()

        future = asyncio.wrap_future(self.pool.submit(job))
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=_DISCONNECT_POLL_S)
                if done:
                    try:
                        return future.result()
                    except CompileCancelledError:
                        raise ClientGone from None
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            if not future.done():
                cancelled.set()
                future.cancel()

    async def start(
        self,
        request: Request,
        sequences: int,
        make_requests: Callable[[], list[EngineRequest]],
        user: str | None = None,
    ) -> EngineCall:
        """Admit `sequences` for the request's client (`user`: the body's field), make the
        engine requests off the event loop (`make_requests`: tokenize, validate, compile)
        and submit them all; nothing is submitted unless every one is valid."""
        self.check_admitting()
        client = client_identity(request, user)
        try:
            self._check_room(client, sequences)
        except APIError as error:
            self.metrics.record_client(client, sequences, refused=error.code or "too_large")
            raise
        self.metrics.record_client(client, sequences)
        self.in_flight += sequences  # reserved now: the awaits below let others in
        self.clients.admit(client, sequences)
        submitted: list[RequestStream] = []
        n = sequences
        try:
            engine_requests = await self.off_loop(request, make_requests)
            if self.aborting:  # shutdown began while it was prepared
                self.check_admitting()
            n = engine_requests[0].num_sequences if engine_requests else 1
            loop = asyncio.get_running_loop()
            for engine_request in engine_requests:
                # Tagged with its client: the engine shares each step between clients.
                tagged = engine_request.replace(client_id=client)
                submitted.append(self.engine.submit(tagged, loop=loop))
        except BaseException:
            self.in_flight -= sequences - len(submitted) * n
            self.clients.release(client, sequences - len(submitted) * n)
            if submitted:  # the pumps of what went in release those sequences
                EngineCall(self, submitted, n, client).close()
            raise
        return EngineCall(self, submitted, n, client)

    def _check_room(self, client: str, sequences: int) -> None:
        """The server-wide bound, then the client's own (clients.py): a 400 for a request
        that can never fit, a 429 for a client at its limit, a 503 when all are full."""
        limit = self.max_queue_len
        if limit is not None and sequences > limit:
            raise APIError(
                400,
                f"this request needs {sequences} sequences (prompts x n) but the server admits "
                f"at most {limit} at a time; split it",
                param="n",
            )
        self.clients.check(client, sequences)
        if limit is not None and self.in_flight + sequences > limit:
            raise APIError(
                503,
                f"the server is busy ({self.in_flight} sequences running or waiting, limit "
                f"{limit}); retry later",
                code="queue_full",
            )

    def make_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        max_tokens_given: bool = False,
        priority: int = 0,
        constraint_param: str = "response_format",
    ) -> EngineRequest:
        """One engine request (any thread but the loop's): tokenized and validated by the
        engine; a max_tokens the client set that does not fit the context is a 400, as in
        vLLM and OpenAI (left unset, generation runs to the end of the context), and so is
        a min_tokens that does not fit. constraint_param: the field a constraint that does
        not compile is blamed on."""
        try:
            engine_request = self.engine.process_inputs(
                prompt, params, request_id, priority=priority, cache_salt=cache_salt
            )
        except (ValueError, CompileCancelledError):
            raise
        except CompilerUnavailableError as error:
            # The server's compiler process is down (it restarts on the next compile): not
            # the client's schema, so not a 400.
            logger.warning("the grammar compiler is unavailable: %s", error)
            raise APIError(
                503, "the structured-output compiler is restarting; retry the request",
                code="compiler_unavailable",
            ) from error  # fmt: skip
        except Exception as error:
            # Compiling a client's schema or grammar can fail in the grammar library with
            # its own exception types; the schema came from the client, so it is a 400.
            if params.structured_outputs is None:
                raise
            logger.info("structured-output constraint rejected: %r", str(error)[:300])
            raise APIError(
                400, "the structured-output constraint could not be compiled",
                param=constraint_param,
            ) from error  # fmt: skip
        max_len = self.engine.max_model_len
        prompt_len = len(engine_request.prompt_token_ids)
        wanted = params.max_tokens if max_tokens_given else None
        if wanted is not None and prompt_len + wanted > max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; the request asks "
                f"for {prompt_len + wanted} ({prompt_len} in the prompt, {wanted} to "
                f"generate): lower max_tokens to at most {max_len - prompt_len} or leave it unset",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if params.min_tokens and prompt_len + params.min_tokens > max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; min_tokens "
                f"{params.min_tokens} cannot be generated after {prompt_len} prompt tokens: "
                f"lower min_tokens to at most {max_len - prompt_len}",
                param="min_tokens",
                code="context_length_exceeded",
            )
        return engine_request

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class EngineCall:
    """The engine requests of one HTTP request, merged; `close()` aborts what is left."""

    def __init__(self, state: ServerState, streams: list[RequestStream], n: int, client: str):
        self.state = state
        self.streams = streams
        self.n = n
        self.client = client
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        self._pumping = len(streams)
        self._aborted = False
        if streams:
            state.open_calls.add(self)
        for index, stream in enumerate(streams):
            state.spawn(self._pump(index, stream))

    async def _pump(self, index: int, stream: RequestStream) -> None:
        generated = [0] * self.n
        final: RequestOutput | None = None
        try:
            async for output in stream:
                for completion in output.outputs:
                    generated[completion.index] += len(completion.token_ids)
                final = output
                self._queue.put_nowait((index, output))
        except BaseException as error:  # RequestError, EngineDeadError, cancellation
            self._queue.put_nowait((index, error))
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            self.state.in_flight -= self.n
            self.state.clients.release(self.client, self.n)
            self._pumping -= 1
            if not self._pumping:
                self.state.open_calls.discard(self)
            self._queue.put_nowait((index, None))
            if final is not None and any(c.finish_reason == "abort" for c in final.outputs):
                # The engine's step never saw these finish; count them here.
                self.state.metrics.record_aborted(len(final.prompt_token_ids), generated)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) in arrival order; raises the first stream error."""
        while self._open:
            index, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def finals(self) -> list[RequestOutput]:
        """The final output of every prompt, in prompt order."""
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        async for index, output in self:
            if output.finished:
                finals[index] = output
        assert all(f is not None for f in finals), "a stream always ends with a final output"
        return finals  # type: ignore[return-value]

    def close(self) -> None:
        """Abort every request still running (client gone or response failed). Idempotent."""
        if self._aborted:
            return
        self._aborted = True
        for stream in self.streams:
            if not stream.finished:
                self.state.engine.abort(stream.request_id)


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON object.

    ASCII-only on purpose: token text can hold U+2028, U+0085 and the like, which many SSE
    readers (httpx's iter_lines among them) take for line breaks and cut the event at.
    """
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def finals_unless_disconnected(request: Request, call: EngineCall) -> list[RequestOutput]:
    """Wait for a non-streamed response; if the client leaves first, abort its requests.

    Starlette cancels a streaming response when its client leaves but not a plain one, so
    the disconnect is polled here (cheaply: a non-blocking look at the receive channel).
    """
    task = asyncio.ensure_future(call.finals())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
        call.close()


_DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The client closed its connection before its response was ready."""
