"""The boundary between the front ends and the engine: `EngineClient`.

LangChain, LlamaIndex, the OpenAI server, `LLM` and the CLI talk to an engine only through
this interface (an abstract base class). Two classes implement it: `AsyncEngine` (one
engine in this process, behind its thread) and `RayReplicaEngine` (data-parallel replicas
on Ray). No front end reaches past it into `LLMEngine`, so a replica engine, which has no
model in this process, serves every front end the same way.

    front end ──> EngineClient ──> AsyncEngine ──> engine thread ──> LLMEngine
                                └─> RayReplicaEngine ──> Ray actors ──> AsyncEngine each
"""

from __future__ import annotations

import asyncio
import queue
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from .engine_request import EngineRequest
from .model_info import ModelInfo, PromptType

if TYPE_CHECKING:
    from .async_engine import RequestStream
    from .config import EngineConfig
    from .input_processor import InputProcessor
    from .metrics import SchedulerStats
    from .outputs import EmbeddingRequestOutput, RequestOutput
    from .pooling import PoolingParams
    from .sampling_params import SamplingParams


# An engine step (or the engine thread) that has not moved for this long while requests
# wait is reported as wedged by `EngineClient.health`.
DEFAULT_STALL_SECONDS = 60.0


class EngineClient(ABC):
    """Everything a front end may call on an engine, from any thread or event loop.

    The model facts and request validation come from the implementation's
    `InputProcessor` (`self._inputs`); add_request / generate / generate_sync / close are
    built here on its primitives (`submit`, `abort`, `shutdown`), which it implements.
    """

    config: EngineConfig
    _inputs: InputProcessor

    # -------------------------------------------------------------- the model
    @property
    def model_info(self) -> ModelInfo:
        return self._inputs.info

    @property
    def tokenizer(self) -> Any:
        return self._inputs.tokenizer

    @property
    def model_name(self) -> str:
        return self._inputs.info.name

    @property
    def max_model_len(self) -> int:
        return self._inputs.info.max_model_len

    @property
    def grammar_compiles(self) -> int:
        """Constraints compiled by this client's input processor so far (cache misses)."""
        return self._inputs.grammar_compiles

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The model's chat template applied to OpenAI-style messages (text, no tokens)."""
        return self._inputs.apply_chat_template(messages, add_generation_prompt, **kwargs)

    def process_inputs(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> EngineRequest:
        """Tokenize and validate a request on the caller's thread (ValueError when bad; a
        constraint's grammar is compiled here); hand the frozen result to `submit`."""
        return self._inputs.process_inputs(prompt, params, request_id, priority, cache_salt)

    def add_request(
        self: Any,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> RequestStream:
        """Submit a request from any thread. Bad input raises ValueError here, in the caller."""
        request = self.process_inputs(prompt, params, request_id, priority, cache_salt)
        return self.submit(request, loop=loop, sink=sink)

    async def generate(
        self: Any,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs on the running event loop; aborts it if abandoned."""
        stream = self.add_request(
            prompt, params, request_id, priority, cache_salt, loop=asyncio.get_running_loop()
        )
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def generate_sync(
        self: Any,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Stream a request's outputs on this thread; aborts it if the iterator is dropped."""
        stream = self.add_request(prompt, params, request_id, priority, cache_salt)
        try:
            yield from stream
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    # ----------------------------------------------------------- embeddings
    def process_embedding_inputs(
        self,
        prompts: list[PromptType],
        params: PoolingParams | None = None,
        priority: int = 0,
    ) -> list[EngineRequest]:
        """Tokenize and validate embedding requests on the caller's thread (ValueError
        naming the first bad input; nothing is made unless all are good)."""
        return self._inputs.process_embedding_batch(list(prompts), params, priority)

    def embed_sync(
        self: Any,
        prompts: list[PromptType],
        params: PoolingParams | None = None,
        priority: int = 0,
    ) -> list[EmbeddingRequestOutput]:
        """Embed prompts on this thread, all submitted at once (the scheduler batches
        them); outputs in the prompts' order. A request the engine failed raises
        RequestError; if this call is interrupted, the requests still running are aborted."""
        requests = self.process_embedding_inputs(prompts, params, priority)
        done: queue.Queue = queue.Queue()
        streams = self.submit_many(requests, sink=done)
        results: dict[str, Any] = {}
        try:
            while len(results) < len(streams):
                item = done.get()
                if isinstance(item, BaseException):
                    raise item
                results[item.request_id] = _check_embedding(item)
        finally:
            for stream in streams:
                if stream.request_id not in results:
                    self.abort(stream.request_id)
        return [results[stream.request_id] for stream in streams]

    async def embed(
        self: Any,
        prompts: list[PromptType],
        params: PoolingParams | None = None,
        priority: int = 0,
    ) -> list[EmbeddingRequestOutput]:
        """`embed_sync` on the running event loop: the loop never waits on the engine
        (tokenizing many texts runs in a worker thread); cancelling aborts the requests."""
        loop = asyncio.get_running_loop()
        prompts = list(prompts)
        if len(prompts) > 8:  # tokenizing a long list would hold the loop
            requests = await asyncio.to_thread(
                self.process_embedding_inputs, prompts, params, priority
            )
        else:
            requests = self.process_embedding_inputs(prompts, params, priority)
        streams = self.submit_many(requests, loop=loop)

        async def final(stream: RequestStream) -> Any:
            last = None
            async for output in stream:
                last = output
            return _check_embedding(last)

        try:
            return list(await asyncio.gather(*(final(s) for s in streams)))
        finally:
            for stream in streams:
                if not stream.finished:
                    self.abort(stream.request_id)

    def precompute(self, prompt: PromptType, cache_salt: str | None = None) -> int:
        """The same as `save_prefix(prompt)`."""
        return self.save_prefix(prompt, cache_salt)

    def close(self: Any) -> None:
        """The same as `shutdown()`."""
        self.shutdown()

    def __enter__(self: Any) -> Any:
        return self

    def __exit__(self: Any, *exc: object) -> None:
        self.shutdown()

    def health(self, stall_after: float = DEFAULT_STALL_SECONDS) -> str | None:
        """None while the engine serves requests; else why it does not. Reads flags only
        (a load balancer's probe must cost nothing); implementations add what they track,
        such as a step that has run for more than `stall_after` seconds."""
        return None if self.is_running else "the engine is not running"

    # --------------------------------------------------- what each implements
    @property
    @abstractmethod
    def is_running(self) -> bool:
        """True while the engine serves requests (not shut down, not dead)."""

    @abstractmethod
    def submit(
        self,
        request: EngineRequest,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> RequestStream:
        """Submit a request made by `process_inputs` (the same object, as it is: the engine
        builds its own state for it); its outputs come on the stream (an asyncio one when
        `loop` is given; into `sink` when given)."""

    @abstractmethod
    def submit_many(
        self,
        requests: list[EngineRequest],
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> list[RequestStream]:
        """Submit requests together, so the scheduler sees them in one step."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request from any thread; its stream gets a final 'abort' output."""

    @property
    @abstractmethod
    def counters(self) -> Any:
        """Engine counters (`snapshot()` gives a dict)."""

    @abstractmethod
    def scheduler_stats(self) -> SchedulerStats: ...

    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @abstractmethod
    def num_total_blocks(self) -> int: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def save_prefix(self, prompt: PromptType, cache_salt: str | None = None) -> int:
        """Compute `prompt` (what the prefix cache does not hold already) and write its full
        KV blocks to the prefix-cache directory, so that later requests that start with it,
        in this process or in a new one, load them instead of computing them. Returns the
        prompt tokens now on disk (whole blocks; a trailing partial block is not saved).
        A ValueError when the engine has no `prefix_cache_dir`."""

    @abstractmethod
    def add_stat_logger(self, stat_logger: Any) -> None: ...

    @abstractmethod
    def remove_stat_logger(self, stat_logger: Any) -> None: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Stop serving and free the model's memory. Idempotent."""


def _check_embedding(output: Any) -> Any:
    """The output of a finished embedding request; RuntimeError when it has no vector (it
    was aborted, or the engine shut down under it)."""
    if output is not None and output.error is not None:
        from .async_engine import RequestError

        raise RequestError(f"request {output.request_id} failed: {output.error}")
    if output is None or output.outputs is None:
        reason = "no output" if output is None else output.finish_reason or "no vector"
        raise RuntimeError(f"embedding request ended without a vector ({reason})")
    return output
