"""LlamaIndex LLM over the in-process paged engine: `PagedLlamaIndexLLM`.

    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM
    llm = PagedLlamaIndexLLM(temperature=0, max_new_tokens=128)  # the embedded SmolLM2
    index.as_query_engine(llm=llm, streaming=True).query("...")

Every instance with the same model and engine settings talks to one shared engine (created
on first use, never at construction), so query engines, agents and coroutines become one
continuously batched stream of work and share one prefix cache. The async methods prepare
the request (chat template, tokens, grammar) on a worker thread and then await the engine's
queue: they never block the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import llama_index.core.instrumentation as instrument
    from llama_index.core.base.llms.generic_utils import (
        messages_to_prompt as generic_messages_to_prompt,
    )
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        LLMMetadata,
        MessageRole,
    )
    from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr, model_validator
    from llama_index.core.constants import DEFAULT_NUM_OUTPUTS, DEFAULT_TEMPERATURE
    from llama_index.core.instrumentation.events.llm import (
        LLMStructuredPredictEndEvent,
        LLMStructuredPredictStartEvent,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.core.llms.llm import ToolSelection
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'PagedLlamaIndexLLM needs llama-index-core: pip install "pagedllm[llama-index]"'
    ) from error

from .engine.async_engine import AsyncEngine
from .engine.config import EngineConfig
from .engine.factory import shared_engine
from .engine.llm_engine import PromptType
from .engine.outputs import RequestOutput
from .engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from .engine.tool_calls import render_chat_prompt, tool_call_constraint
from .llama_index_convert import (
    Deltas,
    PartialObject,
    afollow,
    alast,
    chat_response,
    completion_response,
    follow,
    keep_first_tool_call,
    last,
    to_openai_messages,
    tool_selections,
)

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

logger = logging.getLogger(__name__)
dispatcher = instrument.get_dispatcher(__name__)

__all__ = ["PagedLlamaIndexLLM", "to_openai_messages"]

# What the engine calls the embedded model when no model is given (engine/model_loader.py).
_DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Per-call keyword arguments that are ours rather than sampling parameters.
_CALL_KWARGS = {
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "structured_outputs",
    "max_new_tokens",
}
# Keyword arguments LlamaIndex's own helpers pass down; they carry nothing for generation.
_FRAMEWORK_KWARGS = {"allow_parallel_tool_calls", "verbose", "formatted"}
_SAMPLING_NAMES = {
    name for name in SamplingParams.__dataclass_fields__ if not name.startswith("_")
} - {"output_kind"}


class PagedLlamaIndexLLM(FunctionCallingLLM):
    """A LlamaIndex `FunctionCallingLLM` served by pagedllm's paged, batching engine."""

    model: str | None = Field(
        default=None, description="GGUF file, HF folder or hub id; None: embedded SmolLM2."
    )
    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0.0, description="0 is greedy.")
    max_new_tokens: int = Field(default=DEFAULT_NUM_OUTPUTS, gt=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, description="0 or -1: no limit.")
    seed: int | None = Field(default=None)
    stop: list[str] | None = Field(default=None, description="Stop strings, for every call.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="EngineConfig fields (max_model_len, dtype, ...)."
    )
    sampling_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Other SamplingParams fields (repetition_penalty, ...)."
    )

    _config: EngineConfig = PrivateAttr()
    _engine: AsyncEngine | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_settings(self) -> PagedLlamaIndexLLM:
        # Bad settings fail here, at construction, not at the first call minutes later.
        if "model" in self.engine_kwargs:
            raise ValueError("give the model as model=..., not inside engine_kwargs")
        self._config = EngineConfig.from_kwargs(model=self.model, **self.engine_kwargs)
        self._sampling_params({})
        return self

    @classmethod
    def class_name(cls) -> str:
        return "PagedLlamaIndexLLM"

    # ------------------------------------------------------------------ engine
    @property
    def engine(self) -> AsyncEngine:
        """The shared engine for this model and settings; loads the model on first use."""
        if self._engine is None or self._engine._stopped:
            self._engine = shared_engine(self._config)
        return self._engine

    async def _aengine(self) -> AsyncEngine:
        # Loading takes seconds: do it off the event loop.
        if self._engine is None or self._engine._stopped:
            self._engine = await asyncio.to_thread(shared_engine, self._config)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        loaded = self._engine is not None
        if loaded or self._config.max_model_len is None:
            context_window, model_name = self.engine.max_model_len, self.engine.model_name
        else:
            context_window = self._config.max_model_len
            # Named as the engine will name it (model_loader.resolve_model).
            path = Path(self.model) if self.model else None
            model_name = self._config.served_model_name or (
                (path.stem if path.suffix == ".gguf" else path.name)
                if path
                else _DEFAULT_MODEL_NAME
            )
        return LLMMetadata(
            context_window=context_window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=model_name,
        )

    # ---------------------------------------------------------------- requests
    def _sampling_params(self, kwargs: dict[str, Any], stream: bool = False) -> SamplingParams:
        unknown = set(kwargs) - _SAMPLING_NAMES - _CALL_KWARGS - _FRAMEWORK_KWARGS
        if unknown:
            raise ValueError(
                f"unknown argument(s) {sorted(unknown)}; sampling parameters are "
                f"{sorted(_SAMPLING_NAMES)}, plus tools and tool_choice for chat"
            )
        values: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "max_tokens": self.max_new_tokens,
        }
        values.update(self.sampling_kwargs)
        values.update({k: v for k, v in kwargs.items() if k in _SAMPLING_NAMES})
        if "max_new_tokens" in kwargs:
            values["max_tokens"] = kwargs["max_new_tokens"]
        # The instance's stop strings always apply; a call's own are added to them.
        call_stop = values.get("stop") or []
        call_stop = [call_stop] if isinstance(call_stop, str) else list(call_stop)
        values["stop"] = [*(self.stop or []), *call_stop]
        if values.get("n", 1) != 1:
            raise ValueError("n must be 1 here: LlamaIndex takes one answer; call again for more")
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams.from_kwargs(output_kind=kind, **values)

    def _chat_request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], stream: bool
    ) -> tuple[PromptType, SamplingParams, list[dict] | None]:
        """The prompt for a conversation, its sampling params and the tools it offers."""
        tools = kwargs.get("tools") or None
        tool_choice = kwargs.get("tool_choice")
        params = self._sampling_params(kwargs, stream)
        to_prompt = self.messages_to_prompt
        if to_prompt is not None and to_prompt is not generic_messages_to_prompt:
            # The user's own formatting wins over the model's chat template.
            return to_prompt(messages), params, tools
        tokenizer = self.engine.tokenizer
        text = render_chat_prompt(
            tokenizer, to_openai_messages(messages), tools=tools, tool_choice=tool_choice
        )
        if tools and params.structured_outputs is None:
            parallel = bool(kwargs.get("parallel_tool_calls"))
            constraint = tool_call_constraint(tools, tool_choice, parallel_tool_calls=parallel)
            if constraint is not None:  # "required" or a named tool: force a valid call
                params = params.clone(structured_outputs=constraint)
        # The template already holds any BOS token: the tokenizer must not add another.
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return {"prompt_token_ids": ids}, params, tools

    def _completion_request(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any], stream: bool
    ) -> tuple[PromptType, SamplingParams, None]:
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        return prompt, self._sampling_params(kwargs, stream), None

    def _start(self, request: tuple) -> tuple[Iterator[RequestOutput], list[dict] | None]:
        """Submit now (bad input raises here, in the caller); outputs as they come."""
        prompt, params, tools = request
        stream = self.engine.add_request(prompt, params)
        return follow(self.engine, stream), tools

    async def _astart(
        self, build: Callable[..., tuple], *args: Any
    ) -> tuple[AsyncIterator[RequestOutput], list[dict] | None]:
        """Like _start, but the template, tokenizer and grammar compiler (a first JSON schema
        takes a second or two) run on a worker thread, never on the event loop."""
        engine = await self._aengine()

        def prepare() -> tuple[Any, list[dict] | None]:
            prompt, params, tools = build(*args)
            return engine.process_inputs(prompt, params), tools

        group, tools = await asyncio.to_thread(prepare)
        stream = engine.submit(group, loop=asyncio.get_running_loop())
        return afollow(engine, stream), tools

    # -------------------------------------------------------------- completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        outputs, _ = self._start(self._completion_request(prompt, formatted, kwargs, False))
        return completion_response(last(outputs))

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        outputs, _ = self._start(self._completion_request(prompt, formatted, kwargs, True))
        deltas = Deltas()
        return (completion_response(output, deltas) for output in outputs)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        outputs, _ = await self._astart(self._completion_request, prompt, formatted, kwargs, False)
        return completion_response(await alast(outputs))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        outputs, _ = await self._astart(self._completion_request, prompt, formatted, kwargs, True)
        deltas = Deltas()
        return (completion_response(output, deltas) async for output in outputs)

    # -------------------------------------------------------------------- chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        outputs, tools = self._start(self._chat_request(messages, kwargs, False))
        return chat_response(last(outputs), tools)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        outputs, tools = self._start(self._chat_request(messages, kwargs, True))
        deltas = Deltas()
        return (chat_response(output, tools, deltas) for output in outputs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        outputs, tools = await self._astart(self._chat_request, messages, kwargs, False)
        return chat_response(await alast(outputs), tools)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        outputs, tools = await self._astart(self._chat_request, messages, kwargs, True)
        deltas = Deltas()
        return (chat_response(output, tools, deltas) async for output in outputs)

    # -------------------------------------------------------- function calling
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        messages = list(chat_history or [])
        if user_msg is not None:
            if isinstance(user_msg, str):
                user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
            messages.append(user_msg)
        if tool_choice is None:
            tool_choice = "required" if tool_required else "auto"
        return {
            "messages": messages,
            "tools": [tool.metadata.to_openai_tool() for tool in tools] or None,
            "tool_choice": tool_choice,
            "parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:
            keep_first_tool_call(response.message)
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        selections = tool_selections(response.message)
        if not selections and error_on_no_tool_call:
            raise ValueError(
                "expected at least one tool call, but the model answered with text: "
                f"{(response.message.content or '')[:200]!r}; pass tool_required=True (or "
                "tool_choice) to force a call"
            )
        return selections

    # ------------------------------------------------------- structured output
    def _schema_request(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict | None,
        args: dict,
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        kwargs = dict(llm_kwargs or {})
        kwargs["structured_outputs"] = StructuredOutputsParams(json=output_cls.model_json_schema())
        return self._get_messages(prompt, **args), kwargs

    def _structured_result(self, output_cls: type[BaseModel], response: ChatResponse) -> Any:
        raw = response.raw or {}
        if raw.get("finish_reason") == "length":
            raise ValueError(
                f"the {output_cls.__name__} JSON was cut off after max_new_tokens="
                f"{raw['usage']['completion_tokens']} tokens; raise max_new_tokens "
                "(or bound the schema's strings with max_length)"
            )
        result = output_cls.model_validate_json(response.message.content or "")
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    def structured_predict(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Any:
        """An `output_cls` instance, decoded under the constraint of its JSON schema (the
        engine's structured outputs), not parsed out of free text."""
        dispatcher.event(
            LLMStructuredPredictStartEvent(
                output_cls=output_cls, template=prompt, template_args=prompt_args
            )
        )
        messages, kwargs = self._schema_request(output_cls, prompt, llm_kwargs, prompt_args)
        return self._structured_result(output_cls, self.chat(messages, **kwargs))

    @dispatcher.span
    async def astructured_predict(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Any:
        dispatcher.event(
            LLMStructuredPredictStartEvent(
                output_cls=output_cls, template=prompt, template_args=prompt_args
            )
        )
        messages, kwargs = self._schema_request(output_cls, prompt, llm_kwargs, prompt_args)
        return self._structured_result(output_cls, await self.achat(messages, **kwargs))

    # stream_structured_predict / astream_structured_predict call these two. LlamaIndex's own
    # versions go through a tool call without forcing it; constrained JSON is surer.
    def _structured_stream_call(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[Any, None, None]:
        messages, kwargs = self._schema_request(output_cls, prompt, llm_kwargs, prompt_args)
        partial = PartialObject(output_cls, self)
        return (partial.update(response) for response in self.stream_chat(messages, **kwargs))

    async def _structured_astream_call(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[Any, None]:
        messages, kwargs = self._schema_request(output_cls, prompt, llm_kwargs, prompt_args)
        partial = PartialObject(output_cls, self)
        responses = await self.astream_chat(messages, **kwargs)
        return (partial.update(response) async for response in responses)
