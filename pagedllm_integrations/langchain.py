"""LangChain models backed by the in-process pagedllm engine.

    from pagedllm_integrations.langchain import ChatPagedLLM, PagedLLM
    chat = ChatPagedLLM(temperature=0, max_tokens=128)      # the embedded SmolLM2 model
    llm = PagedLLM(model="path/or/gguf", max_new_tokens=64)  # same arguments as VLLM(...)

Every instance with the same model and engine settings shares one engine (weights, batches
and prefix cache), built on the first call: constructing a wrapper is cheap. Concurrent
calls from threads or tasks are merged by the engine's continuous batching. `close()` (or
a `with` block) gives the engine back; the last one to do so frees its memory.

The constructor also takes the settings of the classes it replaces (VLLM, VLLMOpenAI,
HuggingFacePipeline, OllamaLLM; ChatOllama, ChatHuggingFace, ChatLlamaCpp, ChatOpenAI),
mapped onto its own or refused by name.
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
    from pydantic import ConfigDict, Field, PrivateAttr, model_validator
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'pagedllm_integrations.langchain needs langchain-core: pip install "pagedllm[langchain]"'
    ) from error

from .chat.logprobs import chat_logprobs
from .chat.outputs import Usage
from .chat.sampling import merge_sampling, merge_stops
from .chat.stream import aiter_outputs, arun_all, iter_outputs, run_all
from .engine.client import EngineClient
from .engine.config import EngineConfig
from .engine.engine_request import EngineRequest
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import RequestOutputKind, SamplingParams
from .langchain_embeddings import PagedEmbeddings
from .langchain_support import PROVIDER, split_call_kwargs
from .owner import EngineOwner, build_engine_config
from .peer_settings import peer_settings_validator
from .peer_tables import LLM_PEERS

logger = logging.getLogger(__name__)

__all__ = ["ChatPagedLLM", "PagedEmbeddings", "PagedLLM"]


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
    if call.logprobs is not None and completion.logprobs is not None:
        info["logprobs"] = chat_logprobs(completion.token_ids, completion.logprobs, call.logprobs)
        info["cumulative_logprob"] = completion.cumulative_logprob
    return info


# =============================================================================== PagedLLM
class PagedLLM(EngineOwner, BaseLLM):
    """Text-completion model; takes LangChain `VLLM`'s arguments, plus `engine_kwargs`.

    Unlike `VLLM` it streams real tokens, returns all `n` candidates, keeps the
    init-time `stop` when a call adds its own, and reports logprobs and token usage.
    Sampling settings left at None take the model's generation_config.json defaults, else
    vLLM's neutral ones; `max_new_tokens=None` generates until the end of the answer or of
    the context.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    """A GGUF file, a Hugging Face folder or id; None: the embedded SmolLM2-135M-Instruct."""
    tensor_parallel_size: int | None = 1
    trust_remote_code: bool | None = False
    n: int = 1
    best_of: int | None = None
    """Sample this many and return the `n` with the highest cumulative logprob."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    use_beam_search: bool = False
    stop: list[str] | None = None
    ignore_eos: bool = False
    max_new_tokens: int | None = None
    """Most tokens to generate; None: until the end of the answer or of the context."""
    logprobs: int | None = None
    dtype: str = "auto"
    download_dir: str | None = None
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Engine settings and sampling parameters, as LangChain's VLLM takes them."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Any EngineConfig field: max_model_len, kv_cache_memory, enable_prefix_caching, ..."""
    timeout: float | None = None
    """Seconds a call may take; the request is aborted and TimeoutError raised after it."""
    validate_model_on_init: bool = False
    """True: load the model at construction, so that a bad model fails there."""

    _config: EngineConfig = PrivateAttr()
    _setting_names: dict[str, str] = PrivateAttr(default_factory=dict)
    _engine: EngineClient | None = PrivateAttr(default=None)
    _sampling_extra: dict[str, Any] = PrivateAttr(default_factory=dict)

    # Settings of the libraries this class replaces, mapped onto its own or refused. Defined
    # above the after-validator below, which therefore runs after it (peer_settings.py).
    _peer_settings = peer_settings_validator(LLM_PEERS, "engine_kwargs", "vllm_kwargs")

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
        # A bad sampling value fails here, not at the first call.
        defaults = {k: v for k, v in self._default_params().items() if k != "best_of"}
        SamplingParams.from_kwargs(**merge_sampling({}, defaults, self._sampling_extra))
        if self.validate_model_on_init:
            self._get_engine()
        return self

    @classmethod
    def from_model_id(
        cls,
        model_id: str,
        task: str = "text-generation",
        backend: str = "default",
        device: int | None = None,
        device_map: str | None = None,
        model_kwargs: dict | None = None,
        pipeline_kwargs: dict | None = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> PagedLLM:
        """HuggingFacePipeline.from_model_id's signature: `model_id` and the generation
        settings of `pipeline_kwargs` are honoured; device -1 is the CPU, k >= 0 GPU k."""
        if task != "text-generation":
            raise ValueError(f"task={task!r}: pagedllm generates text ('text-generation') only")
        if backend not in ("default", "pt"):
            raise ValueError(f"backend={backend!r}: pagedllm is its own backend; drop it")
        if device_map not in (None, "auto"):
            raise ValueError(f"device_map={device_map!r}: choose device=-1 (CPU) or device=k")
        engine_kwargs = dict(kwargs.pop("engine_kwargs", None) or {})
        if device is not None:
            engine_kwargs["device"] = "cpu" if device < 0 else f"cuda:{device}"
        settings = {
            "model_id": model_id,
            "model_kwargs": model_kwargs,
            "pipeline_kwargs": pipeline_kwargs,
            "batch_size": batch_size,
            "engine_kwargs": engine_kwargs,
            **kwargs,
        }
        return cls(**settings)  # HuggingFacePipeline's names, mapped by _peer_settings

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
        if kwargs.get("max_tokens", self.max_new_tokens) is not None:
            params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_new_tokens)
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` as the engine reads a prompt (the model's own tokenizer)."""
        return self._token_ids(text, add_special_tokens=True)

    def _params(
        self, engine: EngineClient, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> _Call:
        base = self._default_params()
        best_of = kwargs.pop("best_of", base.pop("best_of"))
        call = split_call_kwargs(kwargs)
        merged = merge_sampling(
            engine.model_info.generation_defaults, base, self._sampling_extra, call
        )
        merged["stop"] = merge_stops(self.stop, stop, self._sampling_extra.get("stop"),
                                     call.get("stop"))  # fmt: skip
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
    ) -> tuple[EngineClient, list[EngineRequest], _Call]:
        engine = self._get_engine()
        call = self._params(engine, stop, dict(kwargs))
        call.params = call.params.clone(output_kind=kind)
        # Validate every prompt before submitting any: a bad one fails the call, not a half.
        requests = [engine.process_inputs(p, call.params) for p in prompts]
        return engine, requests, call

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
        llm_output = {
            "token_usage": Usage.of(outputs).to_openai(),
            "model_name": self._model_name(),
        }
        return LLMResult(generations=generations, llm_output=llm_output)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        engine, requests, call = self._prepare(prompts, stop, kwargs, RequestOutputKind.FINAL_ONLY)
        return self._result(run_all(engine, requests, self.timeout), call)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # Loading the model and tokenizing run off the event loop.
        engine, requests, call = await asyncio.to_thread(
            self._prepare, prompts, stop, kwargs, RequestOutputKind.FINAL_ONLY
        )
        return self._result(await arun_all(engine, requests, self.timeout), call)

    def _stream_prepare(
        self, prompt: str, stop, kwargs
    ) -> tuple[EngineClient, EngineRequest, _Call]:
        engine, requests, call = self._prepare([prompt], stop, kwargs, RequestOutputKind.DELTA)
        if call.params.n != 1:
            raise ValueError(
                f"streaming returns one candidate; got n={call.n}, best_of={call.params.n}"
            )
        return engine, requests[0], call

    @staticmethod
    def _chunk(output: RequestOutput, call: _Call) -> GenerationChunk | None:
        completion = output.outputs[0]
        call.generated += len(completion.token_ids)
        if not completion.text and not output.finished:
            return None
        info = None
        if output.finished:
            usage = Usage.of([output], completion_tokens=call.generated).to_openai()
            info = {**_info(completion, call), "token_usage": usage}
        return GenerationChunk(text=completion.text, generation_info=info)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine, request, call = self._stream_prepare(prompt, stop, kwargs)
        for output in iter_outputs(engine, request, self.timeout):
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
        engine, request, call = await asyncio.to_thread(self._stream_prepare, prompt, stop, kwargs)
        async for output in aiter_outputs(engine, request, self.timeout):
            chunk = self._chunk(output, call)
            if chunk is None:
                continue
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


from .langchain_chat import ChatPagedLLM  # noqa: E402  (after PagedLLM: it reuses its helpers)
