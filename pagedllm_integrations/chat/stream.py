"""Streaming: the gate that holds back text that may be a tool call, one streamed choice,
and running engine requests with a deadline (sync and async). Abandoning an iterator, or
running out of time, aborts the request in the engine and frees its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from ..engine.client import EngineClient
from ..engine.engine_request import EngineRequest
from ..engine.outputs import CompletionOutput, RequestOutput
from .outputs import ChatChoice, read_choice
from .tool_calls import CALL_OPEN
from .tool_choice import ToolPlan


class ToolCallGate:
    """Splits streamed text, with tools on offer, into what is surely answer text (shown at
    once) and what may be a tool call (held until the end, when the calls are read).

    Held: output that opens like a bare JSON call (`{`, `[`, a code fence), everything from
    the model's call tag on (`<tool_call>`, `<|tool_call|>`; Gemma's calls have none), and a
    tail that could be the start of that tag.
    """

    def __init__(self, call_open: str = CALL_OPEN) -> None:
        self.call_open = call_open
        self.sent = ""
        self.pending = ""
        self.holding = False

    def feed(self, delta: str) -> str:
        """Add new text; return the part that can be shown now."""
        self.pending += delta
        if self.holding:
            return ""
        if not self.sent:
            head = self.pending.lstrip()
            if not head:
                return ""
            if head[0] in "{[`":
                self.holding = True
                return ""
        index = self.pending.find(self.call_open) if self.call_open else -1
        if index >= 0:
            ready, self.pending = self.pending[:index], self.pending[index:]
            self.holding = True
        else:
            keep = _partial_tag_length(self.pending, self.call_open) if self.call_open else 0
            cut = len(self.pending) - keep
            ready, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += ready
        return ready

    def finish(self) -> str:
        """The held text (to read calls from) at the end of the output."""
        held, self.pending = self.pending, ""
        return held


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@dataclass(slots=True)
class StreamStep:
    text: str  # content to show now
    done: ChatChoice | None = None  # on the last step: all content, the calls, finish reason


class ChoiceStream:
    """One streamed choice, fed the DELTA completions of one sample index."""

    def __init__(self, plan: ToolPlan | None = None):
        self.plan = plan
        tools = plan is not None and plan.tools
        self.gate = ToolCallGate(plan.call_open) if plan is not None and tools else None
        self.num_tokens = 0
        self.content = ""  # the content shown so far
        self.finished = False

    def feed(self, completion: CompletionOutput) -> StreamStep:
        self.num_tokens += len(completion.token_ids)
        shown = completion.text if self.gate is None else self.gate.feed(completion.text)
        if completion.finish_reason is None:
            self.content += shown
            return StreamStep(shown)
        self.finished = True
        held = self.gate.finish() if self.gate is not None else ""
        rest = read_choice(held, completion.finish_reason, self.plan)
        shown += rest.content
        self.content += shown
        return StreamStep(shown, ChatChoice(self.content, rest.tool_calls, rest.finish_reason))


# ------------------------------------------------------------------ running requests
@contextlib.contextmanager
def _deadline(timeout: float | None, expire: Callable[[], None]) -> Iterator[None]:
    """Call `expire` from a timer thread once `timeout` seconds have passed in the block."""
    timer = threading.Timer(timeout, expire) if timeout else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


def iter_outputs(
    engine: EngineClient, request: EngineRequest, timeout: float | None = None
) -> Iterator[RequestOutput]:
    """Submit one request and yield its outputs on this thread.

    A timeout aborts the request in the engine (freeing its KV blocks) and raises
    TimeoutError; a caller that stops iterating early aborts it too.
    """
    stream = engine.submit(request)
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        engine.abort(request.request_id)

    try:
        with _deadline(timeout, expire):
            for output in stream:
                if output.finished and fired.is_set():
                    raise TimeoutError(f"generation did not finish within timeout={timeout}s")
                yield output
    finally:
        if not stream.finished:
            engine.abort(request.request_id)


async def aiter_outputs(
    engine: EngineClient, request: EngineRequest, timeout: float | None = None
) -> AsyncIterator[RequestOutput]:
    """`iter_outputs` for an event loop: outputs arrive via call_soon_threadsafe, so the
    loop never blocks on the engine."""
    loop = asyncio.get_running_loop()
    stream = engine.submit(request, loop=loop)
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        engine.abort(request.request_id)

    handle = loop.call_later(timeout, expire) if timeout else None
    try:
        async for output in stream:
            if output.finished and fired:
                raise TimeoutError(f"generation did not finish within timeout={timeout}s")
            yield output
    finally:
        if handle is not None:
            handle.cancel()
        if not stream.finished:
            engine.abort(request.request_id)


def run_all(
    engine: EngineClient, requests: list[EngineRequest], timeout: float | None = None
) -> list[RequestOutput]:
    """Submit every request before waiting on any, so the engine batches them together;
    the final output of each, in order. A timeout aborts them all and raises TimeoutError."""
    streams = engine.submit_many(requests)
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        for stream in streams:
            engine.abort(stream.request_id)

    try:
        with _deadline(timeout, expire):
            results = [stream.result() for stream in streams]
    finally:
        for stream in streams:
            if not stream.finished:
                engine.abort(stream.request_id)
    if fired.is_set() and any(c.finish_reason == "abort" for r in results for c in r.outputs):
        raise TimeoutError(f"generation did not finish within timeout={timeout}s")
    return results


async def arun_all(
    engine: EngineClient, requests: list[EngineRequest], timeout: float | None = None
) -> list[RequestOutput]:
    """`run_all` on an event loop."""
    return list(await asyncio.gather(*(alast(aiter_outputs(engine, r, timeout)) for r in requests)))


def last(outputs: Iterator[RequestOutput]) -> RequestOutput:
    """The final output of a request's outputs."""
    final = None
    for output in outputs:
        final = output
    assert final is not None, "a request always ends with a final output"
    return final


async def alast(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in outputs:
        final = output
    assert final is not None, "a request always ends with a final output"
    return final
