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
from dataclasses import dataclass, field
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

from .chat.logprobs import chat_logprobs
from .chat.outputs import ChatChoice, Usage, check_complete, read_choice
from .chat.prepare import ChatOptions, prepare_chat
from .chat.sampling import build_sampling_params, merge_stops
from .chat.stream import ChoiceStream, aiter_outputs, arun_all, iter_outputs, run_all
from .chat.token_count import count_chat_tokens
from .chat.tool_choice import ToolPlan, normalize_tool_choice
from .engine.client import EngineClient
from .engine.config import EngineConfig
from .engine.engine_request import EngineRequest
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from .langchain_messages import to_openai_messages
from .langchain_support import PROVIDER, split_call_kwargs
from .langchain_tools import ToolsBinding
from .owner import EngineOwner, build_engine_config
from .peer_options import IN_PROCESS, MAX_RETRIES
from .peer_settings import note_once, peer_settings_validator
from .peer_tables import CHAT_PEERS

logger = logging.getLogger(__name__)


class ChatPagedLLM(EngineOwner, BaseChatModel):
    """Chat model: the model's own chat template, real token streaming (sync and async),
    tool calling with `tool_choice`, structured output by constrained decoding, and
    prefix-cache hits reported as `usage_metadata["input_token_details"]["cache_read"]`."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

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
    """Accepted for drop-in use, with a logged note: an in-process engine has no transient
    errors to retry."""
    api_key: SecretStr | None = Field(default=None, exclude=True)
    """Accepted for drop-in use, with a logged note: there is no server to authenticate to."""
    dtype: str = "auto"
    download_dir: str | None = None
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Any EngineConfig field: max_model_len, kv_cache_memory, enable_prefix_caching, ..."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More SamplingParams fields applied to every call (repetition_penalty, min_tokens...)."""
    validate_model_on_init: bool = False
    """True: load the model at construction, so that a bad model fails there."""

    _config: EngineConfig = PrivateAttr()
    _setting_names: dict[str, str] = PrivateAttr(default_factory=dict)
    _engine: EngineClient | None = PrivateAttr(default=None)
    _sampling_extra: dict[str, Any] = PrivateAttr(default_factory=dict)

    # Settings of the libraries this class replaces, mapped onto its own or refused. Defined
    # above the after-validator below, which therefore runs after it (peer_settings.py).
    _peer_settings = peer_settings_validator(CHAT_PEERS, "engine_kwargs", "model_kwargs")

    @model_validator(mode="after")
    def _check(self) -> ChatPagedLLM:
        explicit = {"model": self.model, "dtype": self.dtype, "download_dir": self.download_dir}
        self._config, self._sampling_extra = build_engine_config(
            explicit, self.engine_kwargs, self.model_kwargs
        )
        structured = self._sampling_extra.get("structured_outputs")
        if isinstance(structured, dict):
            self._sampling_extra["structured_outputs"] = StructuredOutputsParams(**structured)
        # A bad sampling value fails here, not at the first call.
        build_sampling_params({}, self._default_params(), self._sampling_extra)
        if self.api_key is not None:
            note_once(type(self).__name__, "api_key", self.api_key, IN_PROCESS)
        if self.max_retries is not None:
            note_once(type(self).__name__, "max_retries", self.max_retries, MAX_RETRIES)
        if self.validate_model_on_init:
            self._get_engine()
        return self

    @classmethod
    def from_model_id(
        cls,
        model_id: str,
        task: str | None = None,
        backend: str = "pipeline",
        **kwargs: Any,
    ) -> ChatPagedLLM:
        """ChatHuggingFace.from_model_id's signature (the "pipeline" backend, in process)."""
        if backend != "pipeline":
            raise ValueError(
                f"backend={backend!r} calls a remote endpoint; pagedllm runs the model in this "
                "process (backend='pipeline')"
            )
        if task not in (None, "text-generation"):
            raise ValueError(f"task={task!r}: pagedllm generates text ('text-generation') only")
        from .langchain import PagedLLM

        pipeline_keys = ("device", "device_map", "model_kwargs", "pipeline_kwargs", "batch_size")
        pipeline = {k: kwargs.pop(k) for k in pipeline_keys if k in kwargs}
        settings = {"llm": PagedLLM.from_model_id(model_id, **pipeline), **kwargs}
        return cls(**settings)

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

    # ------------------------------------------------------------ token counts
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` by the model's own tokenizer (no special tokens added)."""
        return self._token_ids(text, add_special_tokens=False)

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence | None = None
    ) -> int:
        """The prompt tokens of this conversation: its turns as the model's chat template
        renders them, the tools described in it and the generation prompt. It never counts
        a default system prompt the template adds to a conversation without one, so counts
        of parts add up (`trim_messages` keeps what fits); a conversation that starts with
        a system message counts what usage reports as input_tokens."""
        formatted = [convert_to_openai_tool(t) for t in tools] if tools else None
        return count_chat_tokens(self._get_engine(), to_openai_messages(messages), formatted)

    # ------------------------------------------------------------------ requests
    def _prepare(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], kind
    ) -> tuple[EngineClient, EngineRequest, _ChatCall]:
        """Render the chat template, tokenize and validate (any thread; loads the engine)."""
        engine = self._get_engine()
        kwargs = dict(kwargs)
        extra = dict(self._sampling_extra)
        # A structured output set at construction (ChatOllama's `format`) is a default.
        options = ChatOptions.pop_from(kwargs, extra.pop("structured_outputs", None))
        call = split_call_kwargs(kwargs)
        params = build_sampling_params(
            engine.model_info.generation_defaults,
            self._default_params(),
            extra,
            call,
            stop=merge_stops(self.stop, stop, extra.get("stop"), call.get("stop")),
            output_kind=kind,
        )
        prompt = prepare_chat(engine, to_openai_messages(messages), params, options)
        request = engine.process_inputs(prompt.engine_prompt, prompt.params)
        return engine, request, _ChatCall(prompt.params, prompt.plan)

    def _message(self, output: RequestOutput, index: int, call: _ChatCall) -> ChatGeneration:
        completion = output.outputs[index]
        choice = read_choice(completion.text, completion.finish_reason, call.plan)
        check_complete(call.plan, choice, completion.finish_reason, len(completion.token_ids),
                       call.params.max_tokens)  # fmt: skip
        metadata = self._response_metadata(completion, call, choice)
        message = AIMessage(
            content=choice.content,
            tool_calls=[
                {"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"}
                for c in choice.tool_calls
            ],
            usage_metadata=_usage_metadata(Usage.of([output])) if index == 0 else None,
            response_metadata=metadata,
        )
        return ChatGeneration(
            message=message, generation_info={"finish_reason": metadata["finish_reason"]}
        )

    def _response_metadata(
        self, completion: CompletionOutput, call: _ChatCall, choice: ChatChoice
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "model_name": self._model_name(),
            "model_provider": PROVIDER,
            "finish_reason": choice.finish_reason,
        }
        if completion.stop_reason is not None:
            metadata["stop_reason"] = completion.stop_reason
        if call.params.logprobs is not None and completion.logprobs is not None:
            content = chat_logprobs(completion.token_ids, completion.logprobs, call.params.logprobs)
            metadata["logprobs"] = {"content": content}
        return metadata

    def _combine_llm_outputs(self, llm_outputs: list[dict | None]) -> dict:
        """generate() over several conversations: token usage added up."""
        total = Usage()
        for output in llm_outputs:
            usage = (output or {}).get("token_usage") or {}
            total = total + Usage(
                usage.get("prompt_tokens", 0),
                usage.get("completion_tokens", 0),
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            )
        return {"token_usage": total.to_openai(), "model_name": self._model_name()}

    def _result(self, output: RequestOutput, call: _ChatCall) -> ChatResult:
        generations = [self._message(output, i, call) for i in range(len(output.outputs))]
        return ChatResult(
            generations=generations,
            llm_output={
                "token_usage": Usage.of([output]).to_openai(),
                "model_name": self._model_name(),
            },
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        engine, request, call = self._prepare(messages, stop, kwargs, RequestOutputKind.FINAL_ONLY)
        (output,) = run_all(engine, [request], self.timeout)
        return self._result(output, call)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        engine, request, call = await asyncio.to_thread(
            self._prepare, messages, stop, kwargs, RequestOutputKind.FINAL_ONLY
        )
        (output,) = await arun_all(engine, [request], self.timeout)
        return self._result(output, call)

    # ----------------------------------------------------------------- streaming
    def _stream_prepare(self, messages, stop, kwargs) -> tuple[EngineClient, EngineRequest, Any]:
        engine, request, call = self._prepare(messages, stop, kwargs, RequestOutputKind.DELTA)
        if call.params.n != 1:
            raise ValueError(f"streaming returns one candidate; got n={call.params.n}")
        return engine, request, call

    def _chunks(self, output: RequestOutput, call: _ChatCall) -> Iterator[ChatGenerationChunk]:
        """Chunks for one engine output (DELTA text). With tools on offer, text that may be
        a tool call is held back until the end, when the calls are read."""
        completion = output.outputs[0]
        step = call.stream.feed(completion)
        if step.done is None:
            if step.text:
                yield ChatGenerationChunk(message=AIMessageChunk(content=step.text))
            return
        check_complete(call.plan, step.done, completion.finish_reason, call.stream.num_tokens,
                       call.params.max_tokens)  # fmt: skip
        metadata = self._response_metadata(completion, call, step.done)
        chunk = AIMessageChunk(
            content=step.text,
            tool_call_chunks=[
                {
                    "name": c.name,
                    "args": json.dumps(c.arguments, ensure_ascii=False),
                    "id": c.id,
                    "index": i,
                    "type": "tool_call_chunk",
                }
                for i, c in enumerate(step.done.tool_calls)
            ],
            usage_metadata=_usage_metadata(
                Usage.of([output], completion_tokens=call.stream.num_tokens)
            ),
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
        engine, request, call = self._stream_prepare(messages, stop, kwargs)
        for output in iter_outputs(engine, request, self.timeout):
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
        engine, request, call = await asyncio.to_thread(
            self._stream_prepare, messages, stop, kwargs
        )
        async for output in aiter_outputs(engine, request, self.timeout):
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
        if tool_choice is not None:
            kwargs["tool_choice"] = normalize_tool_choice(tool_choice, formatted)
        # Its with_structured_output is refused: LangChain's would drop the tools.
        return ToolsBinding(bound=self, kwargs={"tools": formatted, **kwargs}, config={})

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
    plan: ToolPlan
    stream: ChoiceStream = field(init=False)  # streaming: tokens so far, the tool-call gate

    def __post_init__(self) -> None:
        self.stream = ChoiceStream(self.plan)


def _usage_metadata(usage: Usage) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_token_details={"cache_read": usage.cached_tokens},
    )
