"""Plumbing shared by PagedLLM and ChatPagedLLM: engine and sampling settings, the lazy
shared engine, running requests with a deadline (sync and async), usage and logprobs.

Nothing here loads a model: the engine is built on the first call, never at construction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from .engine.async_engine import AsyncEngine
from .engine.config import EngineConfig
from .engine.factory import shared_engine
from .engine.llm_engine import RequestGroup
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams

PROVIDER = "pagedllm"  # ls_provider and response_metadata["model_provider"]
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


class EngineOwner:
    """Lazy access to the shared engine of a wrapper (mixed into both pydantic models, which
    declare the private attributes `_config` and `_engine`)."""

    _config: EngineConfig
    _engine: AsyncEngine | None

    def _get_engine(self) -> AsyncEngine:
        # A shut-down engine (shutdown_shared_engines, a test) is replaced on the next call.
        if self._engine is None or self._engine._stopped:
            self._engine = shared_engine(self._config)
        return self._engine

    @property
    def engine(self) -> AsyncEngine:
        """The shared engine (loads the model on first access)."""
        return self._get_engine()

    def _model_name(self) -> str:
        if self._engine is not None:
            return self._engine.model_name
        return display_model_name(self._config)


def merge_sampling(
    base: dict[str, Any], extra: dict[str, Any], call: dict[str, Any], stops
) -> dict:
    """Instance defaults < vllm_kwargs < call-time kwargs; stop strings are merged."""
    merged = {k: v for k, v in base.items() if v is not None}
    merged.update(extra)
    merged.update(split_call_kwargs(call))
    merged["stop"] = merge_stops(*stops, extra.get("stop"), call.get("stop"))
    return merged


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
