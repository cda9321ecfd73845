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
    from llama_index.core.bridge.pydantic import (
        BaseModel,
        ConfigDict,
        Field,
        PrivateAttr,
        model_validator,
    )
    from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
    from llama_index.core.instrumentation.events.llm import (
        LLMStructuredPredictEndEvent,
        LLMStructuredPredictStartEvent,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'PagedLlamaIndexLLM needs llama-index-core: pip install "pagedllm[llama-index]"'
    ) from error

from .chat.prepare import ChatOptions, prepare_chat
from .chat.sampling import SAMPLING_FIELDS, build_sampling_params, merge_stops
from .chat.stream import aiter_outputs, alast, iter_outputs, last
from .chat.tool_choice import ToolPlan, plan_tools
from .chat.tool_formats import model_tool_format
from .engine.client import EngineClient, PromptType
from .engine.config import EngineConfig
from .engine.outputs import RequestOutput
from .engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from .llama_index_convert import (
    CallState,
    PartialObject,
    chat_response,
    completion_response,
    keep_first_tool_call,
    to_openai_messages,
    tool_selections,
)
from .llama_index_embeddings import PagedEmbedding
from .owner import EngineOwner, display_model_name
from .peer_settings import peer_settings_validator
from .peer_tables import LLAMA_INDEX_PEERS

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

logger = logging.getLogger(__name__)
dispatcher = instrument.get_dispatcher(__name__)

__all__ = ["PagedEmbedding", "PagedLlamaIndexLLM", "to_openai_messages"]

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
_SAMPLING_NAMES = SAMPLING_FIELDS - {"output_kind"}


class PagedLlamaIndexLLM(EngineOwner, FunctionCallingLLM):
    """A LlamaIndex `FunctionCallingLLM` served by pagedllm's paged, batching engine.

    Sampling settings left at None take the model's generation_config.json defaults, else
    vLLM's neutral ones; `max_new_tokens=None` generates until the end of the answer or of
    the context. The constructor also takes the settings of LlamaIndex's Ollama, Vllm,
    LlamaCPP and OpenAILike, mapped onto these or refused by name. With `is_chat_model`
    (the default), complete() sends its prompt through the chat template, as Ollama's and
    OpenAILike's do. `close()` gives the shared engine back.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None, description="GGUF file, HF folder or hub id; None: embedded SmolLM2."
    )
    temperature: float | None = Field(
        default=None, ge=0.0, description="0 is greedy; None: the model's default."
    )
    max_new_tokens: int | None = Field(
        default=None, gt=0, description="None: until the end of the answer or the context."
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, description="0 or -1: no limit.")
    seed: int | None = Field(default=None)
    stop: list[str] | None = Field(default=None, description="Stop strings, for every call.")
    timeout: float | None = Field(
        default=None, description="Seconds a call may take; then it is aborted (TimeoutError)."
    )
    json_mode: bool = Field(
        default=False, description="Every answer is a JSON object (constrained decoding)."
    )
    is_chat_model: bool = Field(
        default=True,
        description="True: complete() sends the prompt as a user turn of the chat template "
        "(as Ollama's does); False: as it is, and query engines call complete().",
    )
    is_function_calling_model: bool = Field(default=True)
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="EngineConfig fields (max_model_len, dtype, ...)."
    )
    sampling_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Other SamplingParams fields (repetition_penalty, ...)."
    )

    _config: EngineConfig = PrivateAttr()
    _setting_names: dict[str, str] = PrivateAttr(default_factory=dict)
    _engine: EngineClient | None = PrivateAttr(default=None)

    # Settings of the libraries this class replaces, mapped onto its own or refused. Defined
    # above the after-validator below, which therefore runs after it (peer_settings.py).
    _peer_settings = peer_settings_validator(LLAMA_INDEX_PEERS, "engine_kwargs", "sampling_kwargs")

    @model_validator(mode="after")
    def _check_settings(self) -> PagedLlamaIndexLLM:
        # Bad settings fail here, at construction, not at the first call minutes later.
        if "model" in self.engine_kwargs:
            raise ValueError("give the model as model=..., not inside engine_kwargs")
        self._config = EngineConfig.from_kwargs(model=self.model, **self.engine_kwargs)
        self._sampling_params({}, {})
        return self

    @classmethod
    def class_name(cls) -> str:
        return "PagedLlamaIndexLLM"

    # ------------------------------------------------------------------ engine
    async def _aengine(self) -> EngineClient:
        # Loading takes seconds: do it off the event loop.
        return await asyncio.to_thread(self._get_engine)

    @property
    def metadata(self) -> LLMMetadata:
        if self._engine is not None or self._config.max_model_len is None:
            context_window, model_name = self.engine.max_model_len, self.engine.model_name
        else:
            context_window = self._config.max_model_len
            model_name = display_model_name(self._config)
        return LLMMetadata(
            context_window=context_window,
            # The room LlamaIndex's prompt helper keeps for the answer; with no limit set,
            # LlamaIndex's own default.
            num_output=self.max_new_tokens or DEFAULT_NUM_OUTPUTS,
            is_chat_model=self.is_chat_model,
            is_function_calling_model=self.is_function_calling_model,
            model_name=model_name,
        )

    # ---------------------------------------------------------------- requests
    def _sampling_params(
        self, kwargs: dict[str, Any], defaults: dict[str, Any] | None = None, stream: bool = False
    ) -> SamplingParams:
        unknown = set(kwargs) - _SAMPLING_NAMES - _CALL_KWARGS - _FRAMEWORK_KWARGS
        if unknown:
            raise ValueError(
                f"unknown argument(s) {sorted(unknown)}; sampling parameters are "
                f"{sorted(_SAMPLING_NAMES)}, plus tools and tool_choice for chat"
            )
        instance = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "max_tokens": self.max_new_tokens,
        }
        call = {k: v for k, v in kwargs.items() if k in _SAMPLING_NAMES}
        if kwargs.get("max_new_tokens") is not None:
            call["max_tokens"] = kwargs["max_new_tokens"]
        if defaults is None:
            defaults = self._get_engine().model_info.generation_defaults
        params = build_sampling_params(
            defaults,
            instance,
            self.sampling_kwargs,
            call,
            # The instance's stop strings always apply; a call's own are added to them.
            stop=merge_stops(self.stop, self.sampling_kwargs.get("stop"), call.get("stop")),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
        if params.n != 1:
            raise ValueError("n must be 1 here: LlamaIndex takes one answer; call again for more")
        return params

    def _options(self, kwargs: dict[str, Any]) -> ChatOptions:
        """The call's tools and structure; json_mode makes any JSON object the default."""
        default = StructuredOutputsParams(json_object=True) if self.json_mode else None
        return ChatOptions.pop_from(dict(kwargs), default)

    def _chat_request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], stream: bool
    ) -> tuple[PromptType, SamplingParams, ToolPlan]:
        """The prompt for a conversation, its sampling params and its tool plan."""
        params = self._sampling_params(kwargs, stream=stream)
        options = self._options(kwargs)
        to_prompt = self.messages_to_prompt
        if to_prompt is not None and to_prompt is not generic_messages_to_prompt:
            # The user's own formatting wins over the model's chat template.
            plan = options.plan(model_tool_format(self.engine))
            return to_prompt(messages), params.clone(structured_outputs=plan.constraint), plan
        prompt = prepare_chat(self.engine, to_openai_messages(messages), params, options)
        return prompt.engine_prompt, prompt.params, prompt.plan

    def _completion_request(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any], stream: bool
    ) -> tuple[PromptType, SamplingParams, ToolPlan]:
        if self._completes_through_chat():
            # As Ollama's and OpenAILike's complete() with is_chat_model: the prompt is the
            # user turn of a chat (after the system_prompt, if one is set).
            messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
            if self.system_prompt:
                messages.insert(0, ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt))
            return self._chat_request(messages, kwargs, stream)
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        plan = plan_tools(None, None, self._options(kwargs).structured)
        params = self._sampling_params(kwargs, stream=stream)
        return prompt, params.clone(structured_outputs=plan.constraint), plan

    def _completes_through_chat(self) -> bool:
        """complete() renders the chat template when the model is a chat model, the user
        gave no completion_to_prompt of their own, and the model has a template."""
        own_format = self.completion_to_prompt not in (None, default_completion_to_prompt)
        if not self.is_chat_model or own_format:
            return False
        return getattr(self.engine.tokenizer, "chat_template", None) is not None

    def _start(self, request: tuple) -> tuple[Iterator[RequestOutput], CallState]:
        """Submit now (bad input raises here, in the caller); outputs as they come."""
        prompt, params, plan = request
        engine_request = self.engine.process_inputs(prompt, params)
        return iter_outputs(self.engine, engine_request, self.timeout), CallState(params, plan)

    async def _astart(
        self, build: Callable[..., tuple], *args: Any
    ) -> tuple[AsyncIterator[RequestOutput], CallState]:
        """Like _start, but the template, tokenizer and grammar compiler (a first JSON schema
        takes a second or two) run on a worker thread, never on the event loop."""
        engine = await self._aengine()

        def prepare() -> tuple[Any, CallState]:
            prompt, params, plan = build(*args)
            return engine.process_inputs(prompt, params), CallState(params, plan)

        engine_request, call = await asyncio.to_thread(prepare)
        return aiter_outputs(engine, engine_request, self.timeout), call

    # -------------------------------------------------------------- completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        outputs, call = self._start(self._completion_request(prompt, formatted, kwargs, False))
        return completion_response(last(outputs), call)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        outputs, call = self._start(self._completion_request(prompt, formatted, kwargs, True))
        return (completion_response(output, call, streaming=True) for output in outputs)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        outputs, call = await self._astart(
            self._completion_request, prompt, formatted, kwargs, False
        )
        return completion_response(await alast(outputs), call)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        outputs, call = await self._astart(
            self._completion_request, prompt, formatted, kwargs, True
        )
        return (completion_response(output, call, streaming=True) async for output in outputs)

    # -------------------------------------------------------------------- chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        outputs, call = self._start(self._chat_request(messages, kwargs, False))
        return chat_response(last(outputs), call)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        outputs, call = self._start(self._chat_request(messages, kwargs, True))
        return (chat_response(output, call, streaming=True) for output in outputs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        outputs, call = await self._astart(self._chat_request, messages, kwargs, False)
        return chat_response(await alast(outputs), call)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        outputs, call = await self._astart(self._chat_request, messages, kwargs, True)
        return (chat_response(output, call, streaming=True) async for output in outputs)

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
        # A cut-off document raised IncompleteOutputError in chat(): this one is whole.
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
