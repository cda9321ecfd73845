"""LangChain models backed by the in-process pagedllm engine.

    from pagedllm_integrations.langchain import ChatPagedLLM, PagedLLM
    chat = ChatPagedLLM(temperature=0, max_tokens=128)      # the embedded SmolLM2 model
    llm = PagedLLM(model="path/or/gguf", max_new_tokens=64)  # same arguments as VLLM(...)

Every instance with the same model and engine settings shares one engine (weights, batches
and prefix cache), built on the first call: constructing a wrapper is cheap. Concurrent
calls from threads or tasks are merged by the engine's continuous batching.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

try:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForLLMRun,
        CallbackManagerForLLMRun,
    )
    from langchain_core.language_models import BaseLLM
    from langchain_core.language_models.base import LangSmithParams
    from langchain_core.outputs import Generation, GenerationChunk, LLMResult
    from pydantic import Field, PrivateAttr, model_validator
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'pagedllm_integrations.langchain needs langchain-core: pip install "pagedllm[langchain]"'
    ) from error

from .engine.async_engine import AsyncEngine
from .engine.config import EngineConfig
from .engine.llm_engine import RequestGroup
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import RequestOutputKind, SamplingParams
from .langchain_support import (
    PROVIDER,
    EngineOwner,
    aiter_outputs,
    arun_all,
    build_engine_config,
    format_logprobs,
    iter_outputs,
    merge_sampling,
    run_all,
    token_usage,
)

logger = logging.getLogger(__name__)

__all__ = ["ChatPagedLLM", "PagedLLM"]


@dataclass(slots=True)
class _Call:
    """The sampling settings of one call, how many candidates to return, and the logprobs
    the caller asked for (best_of may ask the engine for more than that)."""

    params: SamplingParams
    n: int
    logprobs: int | None
    generated: int = 0  # tokens streamed so far (DELTA outputs carry only the new ones)


def _info(completion: CompletionOutput, call: _Call) -> dict[str, Any]:
    info: dict[str, Any] = {
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }
    if call.logprobs is not None:
        info["logprobs"] = format_logprobs(completion, call.logprobs)
        info["cumulative_logprob"] = completion.cumulative_logprob
    return info


# =============================================================================== PagedLLM
class PagedLLM(EngineOwner, BaseLLM):
    """Text-completion model; takes LangChain `VLLM`'s arguments, plus `engine_kwargs`.

    Unlike `VLLM` it streams real tokens, returns all `n` candidates, keeps the
    init-time `stop` when a call adds its own, and reports logprobs and token usage.
    """

    model: str | None = None
    """A GGUF file, a Hugging Face folder or id; None: the embedded SmolLM2-135M-Instruct."""
    tensor_parallel_size: int | None = 1
    trust_remote_code: bool | None = False
    n: int = 1
    best_of: int | None = None
    """Sample this many and return the `n` with the highest cumulative logprob."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    use_beam_search: bool = False
    stop: list[str] | None = None
    ignore_eos: bool = False
    max_new_tokens: int = 512
    logprobs: int | None = None
    dtype: str = "auto"
    download_dir: str | None = None
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Engine settings and sampling parameters, as LangChain's VLLM takes them."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Any EngineConfig field: max_model_len, kv_cache_memory, enable_prefix_caching, ..."""
    timeout: float | None = None
    """Seconds a call may take; the request is aborted and TimeoutError raised after it."""

    _config: EngineConfig = PrivateAttr()
    _engine: AsyncEngine | None = PrivateAttr(default=None)
    _sampling_extra: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> PagedLLM:
        if self.use_beam_search:
            raise ValueError("use_beam_search is not supported; use best_of=k to rank k samples")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        explicit = {
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "trust_remote_code": self.trust_remote_code,
            "dtype": self.dtype,
            "download_dir": self.download_dir,
        }
        self._config, self._sampling_extra = build_engine_config(
            explicit, self.engine_kwargs, self.vllm_kwargs
        )
        return self

    @property
    def _llm_type(self) -> str:
        return "pagedllm"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self._model_name(), **self._default_params(), **self.engine_kwargs}

    def _default_params(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "best_of": self.best_of,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
            "max_tokens": self.max_new_tokens,
            "logprobs": self.logprobs,
            "stop": self.stop,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = kwargs.get("model") or self._model_name()
        params["ls_model_type"] = "llm"
        params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_new_tokens)
        return params

    def _params(self, stop: list[str] | None, kwargs: dict[str, Any]) -> _Call:
        base = self._default_params()
        best_of = kwargs.pop("best_of", base.pop("best_of"))
        merged = merge_sampling(base, self._sampling_extra, kwargs, (self.stop, stop))
        n, wanted = merged.get("n", 1), merged.get("logprobs")
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of ({best_of}) must be >= n ({n})")
        if best_of is not None and best_of > n:
            # Ranking needs each sample's cumulative logprob: ask for at least the chosen one.
            merged["n"] = best_of
            merged["logprobs"] = wanted or 0
        return _Call(SamplingParams.from_kwargs(**merged), n, wanted)

    def _prepare(
        self, prompts: list[str], stop: list[str] | None, kwargs: dict[str, Any], kind
    ) -> tuple[AsyncEngine, list[RequestGroup], _Call]:
        engine = self._get_engine()
        call = self._params(stop, dict(kwargs))
        call.params = call.params.clone(output_kind=kind)
        # Validate every prompt before submitting any: a bad one fails the call, not a half.
        groups = [engine.process_inputs(p, call.params) for p in prompts]
        return engine, groups, call

    def _result(self, outputs: list[RequestOutput], call: _Call) -> LLMResult:
        generations = []
        for output in outputs:
            candidates = output.outputs
            if len(candidates) > call.n:  # best_of: keep the n most likely samples
                candidates = sorted(candidates, key=lambda c: -(c.cumulative_logprob or 0.0))
                candidates = candidates[: call.n]
            generations.append(
                [Generation(text=c.text, generation_info=_info(c, call)) for c in candidates]
            )
        llm_output = {"token_usage": token_usage(outputs), "model_name": self._model_name()}
        return LLMResult(generations=generations, llm_output=llm_output)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        engine, groups, call = self._prepare(prompts, stop, kwargs, RequestOutputKind.FINAL_ONLY)
        return self._result(run_all(engine, groups, self.timeout), call)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # Loading the model and tokenizing run off the event loop.
        engine, groups, call = await asyncio.to_thread(
            self._prepare, prompts, stop, kwargs, RequestOutputKind.FINAL_ONLY
        )
        return self._result(await arun_all(engine, groups, self.timeout), call)

    def _stream_prepare(self, prompt: str, stop, kwargs) -> tuple[AsyncEngine, RequestGroup, _Call]:
        engine, groups, call = self._prepare([prompt], stop, kwargs, RequestOutputKind.DELTA)
        if call.params.n != 1:
            raise ValueError(
                f"streaming returns one candidate; got n={call.n}, best_of={call.params.n}"
            )
        return engine, groups[0], call

    @staticmethod
    def _chunk(output: RequestOutput, call: _Call) -> GenerationChunk | None:
        completion = output.outputs[0]
        call.generated += len(completion.token_ids)
        if not completion.text and not output.finished:
            return None
        info = None
        if output.finished:
            prompt = len(output.prompt_token_ids)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": call.generated,
                "total_tokens": prompt + call.generated,
                "cached_prompt_tokens": output.num_cached_tokens,
            }
            info = {**_info(completion, call), "token_usage": usage}
        return GenerationChunk(text=completion.text, generation_info=info)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine, group, call = self._stream_prepare(prompt, stop, kwargs)
        for output in iter_outputs(engine, group, self.timeout):
            chunk = self._chunk(output, call)
            if chunk is None:
                continue
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        engine, group, call = await asyncio.to_thread(self._stream_prepare, prompt, stop, kwargs)
        async for output in aiter_outputs(engine, group, self.timeout):
            chunk = self._chunk(output, call)
            if chunk is None:
                continue
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


from .langchain_chat import ChatPagedLLM  # noqa: E402  (after PagedLLM: it reuses its helpers)
