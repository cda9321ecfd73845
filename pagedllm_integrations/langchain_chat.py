"""ChatPagedLLM: a LangChain chat model on the in-process pagedllm engine.

Import it from `pagedllm_integrations.langchain`. It renders the model's chat template
(tools described in it), streams real tokens (sync and async, off the event loop), forces
tool calls and structured outputs by constrained decoding, and reports prefix-cache hits
as `usage_metadata["input_token_details"]["cache_read"]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from .engine.async_engine import AsyncEngine
from .engine.config import EngineConfig
from .engine.llm_engine import RequestGroup
from .engine.outputs import RequestOutput
from .engine.sampling_params import RequestOutputKind, SamplingParams
from .engine.tool_calls import (
    CALL_OPEN,
    parse_tool_calls,
    render_chat_prompt,
    tool_call_constraint,
)
from .langchain_messages import ToolCallGate, normalize_tool_choice, to_openai_messages
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


class ChatPagedLLM(EngineOwner, BaseChatModel):
    """Chat model: the model's own chat template, real token streaming (sync and async),
    tool calling with `tool_choice`, structured output by constrained decoding, and
    prefix-cache hits reported as `usage_metadata["input_token_details"]["cache_read"]`."""

    model_config = ConfigDict(populate_by_name=True)

    model: str | None = Field(default=None, alias="model_name")
    """A GGUF file, a Hugging Face folder or id; None: the embedded SmolLM2-135M-Instruct."""
    temperature: float | None = None
    max_tokens: int | None = None
    """Most tokens to generate; None: until the end of the answer or of the context."""
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stop: list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    streaming: bool = False
    timeout: float | None = None
    """Seconds a call may take; the request is aborted and TimeoutError raised after it."""
    max_retries: int | None = None
    """Accepted for drop-in use; an in-process engine has no transient errors to retry."""
    api_key: SecretStr | None = Field(default=None, exclude=True)
    """Accepted for drop-in use and ignored: there is no server to authenticate to."""
    dtype: str = "auto"
    download_dir: str | None = None
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Any EngineConfig field: max_model_len, kv_cache_memory, enable_prefix_caching, ..."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More SamplingParams fields applied to every call (repetition_penalty, min_tokens...)."""

    _config: EngineConfig = PrivateAttr()
    _engine: AsyncEngine | None = PrivateAttr(default=None)
    _sampling_extra: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> ChatPagedLLM:
        explicit = {"model": self.model, "dtype": self.dtype, "download_dir": self.download_dir}
        self._config, self._sampling_extra = build_engine_config(
            explicit, self.engine_kwargs, self.model_kwargs
        )
        return self

    @property
    def _llm_type(self) -> str:
        return "pagedllm-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self._model_name(), **self._default_params(), **self.engine_kwargs}

    def _default_params(self) -> dict[str, Any]:
        logprobs = None
        if self.logprobs or self.top_logprobs is not None:
            logprobs = self.top_logprobs or 0
        return {
            "n": self.n,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "logprobs": logprobs,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = kwargs.get("model") or self._model_name()
        params["ls_model_type"] = "chat"
        return params

    # ------------------------------------------------------------------ requests
    def _prepare(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], kind
    ) -> tuple[AsyncEngine, RequestGroup, _ChatCall]:
        """Render the chat template, tokenize and validate (any thread; loads the engine)."""
        engine = self._get_engine()
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None) or None
        tool_choice = kwargs.pop("tool_choice", None)
        structured = kwargs.pop("structured_outputs", None)
        parallel = bool(kwargs.pop("parallel_tool_calls", False))
        if tool_choice == "none":
            tools = None  # the model must answer in text: do not offer tools at all
        constraint = None
        if tools:
            constraint = tool_call_constraint(tools, tool_choice, parallel_tool_calls=parallel)
        if constraint is not None and structured is not None:
            raise ValueError("a call cannot both force a tool call and a structured output")
        merged = merge_sampling(
            self._default_params(), self._sampling_extra, kwargs, (self.stop, stop)
        )
        merged["structured_outputs"] = constraint or structured
        merged["output_kind"] = kind
        params = SamplingParams.from_kwargs(**merged)
        prompt = render_chat_prompt(
            engine.tokenizer,
            to_openai_messages(messages),
            tools=tools,
            tool_choice=tool_choice,
            add_generation_prompt=True,
        )
        # The template already holds any BOS: no second one from the tokenizer.
        ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
        group = engine.process_inputs({"prompt_token_ids": ids}, params)
        logprobs = params.logprobs
        return engine, group, _ChatCall(params, tools, logprobs)

    def _message(self, output: RequestOutput, index: int, call: _ChatCall) -> ChatGeneration:
        completion = output.outputs[index]
        content, tool_calls = self._split_tool_calls(completion.text, call)
        metadata = self._response_metadata(completion, call, bool(tool_calls))
        message = AIMessage(
            content=content,
            tool_calls=[
                {"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"}
                for c in tool_calls
            ],
            usage_metadata=_usage(output, len(completion.token_ids)) if index == 0 else None,
            response_metadata=metadata,
        )
        return ChatGeneration(
            message=message, generation_info={"finish_reason": metadata["finish_reason"]}
        )

    @staticmethod
    def _split_tool_calls(text: str, call: _ChatCall) -> tuple[str, list]:
        if not call.tools:
            return text, []
        return parse_tool_calls(text, call.tools)

    def _response_metadata(self, completion, call: _ChatCall, called: bool) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "model_name": self._model_name(),
            "model_provider": PROVIDER,
            "finish_reason": "tool_calls" if called else completion.finish_reason,
        }
        if completion.stop_reason is not None:
            metadata["stop_reason"] = completion.stop_reason
        if call.logprobs is not None:
            metadata["logprobs"] = {"content": format_logprobs(completion, call.logprobs)}
        return metadata

    def _combine_llm_outputs(self, llm_outputs: list[dict | None]) -> dict:
        """generate() over several conversations: token usage added up."""
        usage: dict[str, int] = {}
        for output in llm_outputs:
            for key, value in ((output or {}).get("token_usage") or {}).items():
                usage[key] = usage.get(key, 0) + value
        return {"token_usage": usage, "model_name": self._model_name()}

    def _result(self, output: RequestOutput, call: _ChatCall) -> ChatResult:
        generations = [self._message(output, i, call) for i in range(len(output.outputs))]
        usage = token_usage([output])
        return ChatResult(
            generations=generations,
            llm_output={"token_usage": usage, "model_name": self._model_name()},
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        engine, group, call = self._prepare(messages, stop, kwargs, RequestOutputKind.FINAL_ONLY)
        (output,) = run_all(engine, [group], self.timeout)
        return self._result(output, call)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        engine, group, call = await asyncio.to_thread(
            self._prepare, messages, stop, kwargs, RequestOutputKind.FINAL_ONLY
        )
        (output,) = await arun_all(engine, [group], self.timeout)
        return self._result(output, call)

    # ----------------------------------------------------------------- streaming
    def _stream_prepare(self, messages, stop, kwargs) -> tuple[AsyncEngine, RequestGroup, Any]:
        engine, group, call = self._prepare(messages, stop, kwargs, RequestOutputKind.DELTA)
        if call.params.n != 1:
            raise ValueError(f"streaming returns one candidate; got n={call.params.n}")
        return engine, group, call

    def _chunks(self, output: RequestOutput, call: _ChatCall) -> Iterator[ChatGenerationChunk]:
        """Chunks for one engine output (DELTA text). With tools bound, text that may be a
        tool call is held back until the end, when `parse_tool_calls` reads it."""
        completion = output.outputs[0]
        call.generated += len(completion.token_ids)
        text = completion.text if call.gate is None else call.gate.feed(completion.text)
        if not output.finished:
            if text:
                yield ChatGenerationChunk(message=AIMessageChunk(content=text))
            return
        tool_calls: list = []
        if call.gate is not None:
            held, tool_calls = self._split_tool_calls(call.gate.finish(), call)
            text += held
        metadata = self._response_metadata(completion, call, bool(tool_calls))
        chunk = AIMessageChunk(
            content=text,
            tool_call_chunks=[
                {
                    "name": c.name,
                    "args": json.dumps(c.arguments, ensure_ascii=False),
                    "id": c.id,
                    "index": i,
                    "type": "tool_call_chunk",
                }
                for i, c in enumerate(tool_calls)
            ],
            usage_metadata=_usage(output, call.generated),
            chunk_position="last",
        )
        yield ChatGenerationChunk(message=chunk, generation_info=metadata)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        engine, group, call = self._stream_prepare(messages, stop, kwargs)
        for output in iter_outputs(engine, group, self.timeout):
            for chunk in self._chunks(output, call):
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        engine, group, call = await asyncio.to_thread(self._stream_prepare, messages, stop, kwargs)
        async for output in aiter_outputs(engine, group, self.timeout):
            for chunk in self._chunks(output, call):
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    # ------------------------------------------------------- tools and structure
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer tools to the model. tool_choice: "auto" (default), "any"/"required" (a
        call is forced by constrained decoding), "none", a tool name, or an OpenAI dict."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = [t["function"]["name"] for t in formatted]
        choice = normalize_tool_choice(tool_choice, names)
        if choice is not None:
            kwargs["tool_choice"] = choice
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | Any]:
        """Answers that fit `schema`, enforced token by token by the engine.

        json_schema: the output is constrained to the schema; json_mode: to any JSON object
        (say in the prompt what to put in it); function_calling: a forced call of a tool
        made from the schema. Pydantic classes are parsed into instances, others into dicts.
        """
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)} for with_structured_output")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema")
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format=trace)
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                if schema is None:
                    raise ValueError("method='json_schema' needs a schema; or use json_mode")
                constraint: dict[str, Any] = {"json": convert_to_json_schema(schema)}
            else:
                constraint = {"json_object": True}
            llm = self.bind(structured_outputs=constraint, ls_structured_output_format=trace)
            parser = (
                PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
                if is_pydantic
                else JsonOutputParser()
            )
        else:
            raise ValueError(
                f"method must be 'json_schema', 'json_mode' or 'function_calling', got {method!r}"
            )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(
            parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
        )
        no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks(
            [no_parse], exception_key="parsing_error"
        )


@dataclass(slots=True)
class _ChatCall:
    params: SamplingParams
    tools: list[dict[str, Any]] | None
    logprobs: int | None
    generated: int = 0  # tokens streamed so far (DELTA outputs carry only the new ones)
    gate: ToolCallGate | None = None  # streaming with tools: holds text that may be a call

    def __post_init__(self) -> None:
        if self.tools and self.params.output_kind == RequestOutputKind.DELTA:
            self.gate = ToolCallGate(CALL_OPEN)


def _usage(output: RequestOutput, generated: int) -> UsageMetadata:
    prompt = len(output.prompt_token_ids)
    return UsageMetadata(
        input_tokens=prompt,
        output_tokens=generated,
        total_tokens=prompt + generated,
        input_token_details={"cache_read": output.num_cached_tokens},
    )
