"""Plumbing shared by the LangChain wrappers: engine settings, sampling settings, running
requests with a deadline (sync and async), and LangChain <-> OpenAI message conversion.

Kept apart from `langchain.py` so that file holds only the two public classes. Nothing
here loads a model: the engine is built on the first call, never at construction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from .engine.async_engine import AsyncEngine
from .engine.config import EngineConfig
from .engine.llm_engine import RequestGroup
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the embedded default model is called

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
SAMPLING_FIELDS = frozenset(
    f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")
)
# Call-time keyword arguments LangChain itself may send that carry no sampling meaning here.
IGNORED_CALL_KWARGS = frozenset({"model", "stream", "parallel_tool_calls", "strict"})


def build_engine_config(
    explicit: dict[str, Any], engine_kwargs: dict[str, Any], vllm_kwargs: dict[str, Any]
) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine config, and the `vllm_kwargs` entries that are sampling parameters.

    `vllm_kwargs` mixes both kinds in LangChain's VLLM; an entry that is neither an engine
    setting nor a sampling parameter is a ValueError, never silently dropped.
    """
    engine_args = {k: v for k, v in explicit.items() if v is not None}
    sampling: dict[str, Any] = {}
    for key, value in vllm_kwargs.items():
        if key in ENGINE_FIELDS or key in ("enforce_eager", "disable_custom_all_reduce"):
            engine_args[key] = value
        elif key in SAMPLING_FIELDS:
            sampling[key] = value
        else:
            raise ValueError(
                f"vllm_kwargs[{key!r}] is neither an engine setting nor a sampling parameter; "
                f"engine settings: {sorted(ENGINE_FIELDS)}; sampling: {sorted(SAMPLING_FIELDS)}"
            )
    engine_args.update(engine_kwargs)
    return EngineConfig.from_kwargs(**engine_args), sampling


def display_model_name(config: EngineConfig) -> str:
    """The name the engine will report, known without loading it."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model)
    if path.suffix == ".gguf":
        return path.stem
    return config.model if not path.exists() else path.name


def merge_stops(*stops: Sequence[str] | str | None) -> list[str]:
    """Init-time and call-time stop strings both apply (first occurrence order, no repeats)."""
    merged: list[str] = []
    for stop in stops:
        if stop is None:
            continue
        for s in [stop] if isinstance(stop, str) else stop:
            if s and s not in merged:
                merged.append(s)
    return merged


def split_call_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Sampling parameters given at call time; anything else is a ValueError naming it."""
    unknown = sorted(set(kwargs) - SAMPLING_FIELDS - IGNORED_CALL_KWARGS)
    if unknown:
        raise ValueError(
            f"unknown call argument(s) {unknown}: pass sampling parameters "
            f"({sorted(SAMPLING_FIELDS)}) or bind tools with bind_tools()"
        )
    return {k: v for k, v in kwargs.items() if k in SAMPLING_FIELDS}


# ----------------------------------------------------------------- running requests
def iter_outputs(
    engine: AsyncEngine, group: RequestGroup, timeout: float | None
) -> Iterator[RequestOutput]:
    """Submit one request and yield its outputs on this thread.

    A timeout aborts the request in the engine (freeing its KV blocks) and raises
    TimeoutError; a caller that stops iterating early aborts it too.
    """
    stream = engine.submit(group)
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        engine.abort(group.request_id)

    timer = threading.Timer(timeout, expire) if timeout else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        for output in stream:
            if output.finished and fired.is_set():
                raise TimeoutError(f"generation did not finish within timeout={timeout}s")
            yield output
    finally:
        if timer is not None:
            timer.cancel()
        if not stream.finished:
            engine.abort(group.request_id)


async def aiter_outputs(
    engine: AsyncEngine, group: RequestGroup, timeout: float | None
) -> AsyncIterator[RequestOutput]:
    """`iter_outputs` for an event loop: outputs arrive via call_soon_threadsafe, so the
    loop never blocks on the engine."""
    loop = asyncio.get_running_loop()
    stream = engine.submit(group, loop=loop)
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        engine.abort(group.request_id)

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
            engine.abort(group.request_id)


def run_all(
    engine: AsyncEngine, groups: list[RequestGroup], timeout: float | None
) -> list[RequestOutput]:
    """Submit every request before waiting on any, so the engine batches them together;
    the final output of each, in order. A timeout aborts them all and raises TimeoutError."""
    streams = [engine.submit(group) for group in groups]
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        for stream in streams:
            engine.abort(stream.request_id)

    timer = threading.Timer(timeout, expire) if timeout else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        results = [stream.result() for stream in streams]
    finally:
        if timer is not None:
            timer.cancel()
        for stream in streams:
            if not stream.finished:
                engine.abort(stream.request_id)
    if fired.is_set() and any(c.finish_reason == "abort" for r in results for c in r.outputs):
        raise TimeoutError(f"generation did not finish within timeout={timeout}s")
    return results


async def arun_all(
    engine: AsyncEngine, groups: list[RequestGroup], timeout: float | None
) -> list[RequestOutput]:
    async def last(group: RequestGroup) -> RequestOutput:
        final = None
        async for final in aiter_outputs(engine, group, timeout):  # noqa: B007
            pass
        assert final is not None
        return final

    return list(await asyncio.gather(*(last(g) for g in groups)))


# ----------------------------------------------------------------------- outputs
def format_logprobs(output: CompletionOutput, top_k: int) -> list[dict[str, Any]] | None:
    """Per-token logprobs in the OpenAI chat shape: token, logprob, top_logprobs.

    Each engine entry holds the sampled token (with its true rank) and the top_k tokens
    (ranks 1..top_k); the sampled token is listed among the top only if its rank is in it.
    """
    if output.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(output.token_ids, output.logprobs):
        chosen = entry.get(token_id)
        if chosen is None:
            continue
        top = sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)
        content.append(
            {
                "token": chosen.decoded_token,
                "logprob": chosen.logprob,
                "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob} for lp in top],
            }
        )
    return content


def token_usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cached_prompt_tokens": cached,
    }


# ---------------------------------------------------------------------- messages
def message_text(content: Any) -> str:
    """Plain text of a message's content (a string or a list of content blocks)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            kind = block.get("type")
            if kind == "text":
                parts.append(block.get("text", ""))
            elif kind in ("image", "image_url", "audio", "input_audio", "file", "video"):
                raise ValueError(
                    f"a {kind!r} content block was given, but pagedllm models read text only"
                )
            # tool_use / thinking / reasoning blocks: the tool calls travel in tool_calls.
    return "".join(parts)


def to_openai_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """LangChain messages -> OpenAI chat dicts, the form `render_chat_prompt` takes."""
    from langchain_core.messages import (
        AIMessage,
        ChatMessage,
        FunctionMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )

    result: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            result.append({"role": "system", "content": message_text(message.content)})
        elif isinstance(message, HumanMessage):
            result.append({"role": "user", "content": message_text(message.content)})
        elif isinstance(message, AIMessage):
            entry: dict[str, Any] = {
                "role": "assistant",
                "content": message_text(message.content),
            }
            if message.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": call.get("id") or f"call_{i}",
                        "type": "function",
                        "function": {
                            "name": call["name"],
                            "arguments": json.dumps(call["args"], ensure_ascii=False),
                        },
                    }
                    for i, call in enumerate(message.tool_calls)
                ]
            result.append(entry)
        elif isinstance(message, ToolMessage):
            entry = {
                "role": "tool",
                "content": message_text(message.content),
                "tool_call_id": message.tool_call_id,
            }
            if message.name:
                entry["name"] = message.name
            result.append(entry)
        elif isinstance(message, FunctionMessage):
            result.append(
                {"role": "tool", "content": message_text(message.content), "name": message.name}
            )
        elif isinstance(message, ChatMessage):
            result.append({"role": message.role, "content": message_text(message.content)})
        else:
            raise ValueError(
                f"cannot send a {type(message).__name__} to the model: use System, Human, AI, "
                "Tool or Chat messages"
            )
    return result


def normalize_tool_choice(tool_choice: Any, tool_names: list[str]) -> str | dict | None:
    """LangChain's tool_choice spellings -> OpenAI's: auto, none, required, or a named tool."""
    if tool_choice is None:
        return None
    if tool_choice == "auto":
        return "auto"
    if tool_choice in ("any", "required"):
        return "required"
    if tool_choice is True:
        if len(tool_names) != 1:
            raise ValueError("tool_choice=True needs exactly one tool; name the tool instead")
        tool_choice = tool_names[0]
    if tool_choice is False or tool_choice == "none":
        return "none"
    if isinstance(tool_choice, str):
        name = tool_choice
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if not name:
            raise ValueError(f"tool_choice dict {tool_choice!r} names no function")
    else:
        raise ValueError(
            f"tool_choice must be 'auto', 'any', 'required', 'none', a tool name or a dict; "
            f"got {tool_choice!r}"
        )
    if name not in tool_names:
        raise ValueError(f"tool_choice names {name!r}, but the bound tools are {tool_names}")
    return {"type": "function", "function": {"name": name}}


class ToolCallGate:
    """Splits streamed text, with tools bound, into what is surely answer text (sent at once)
    and what may be a tool call (held until the end, when `parse_tool_calls` decides).

    Held: output that opens like a bare JSON call (`{`, `[`, a code fence), everything from
    a `<tool_call>` tag on, and a tail that could be the start of that tag.
    """

    def __init__(self, call_open: str) -> None:
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
        index = self.pending.find(self.call_open)
        if index >= 0:
            ready, self.pending = self.pending[:index], self.pending[index:]
            self.holding = True
        else:
            keep = _partial_tag_length(self.pending, self.call_open)
            cut = len(self.pending) - keep
            ready, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += ready
        return ready

    def finish(self) -> str:
        """The held text (to parse for calls) at the end of the output."""
        held, self.pending = self.pending, ""
        return held


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
