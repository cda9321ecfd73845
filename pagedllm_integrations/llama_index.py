"""LlamaIndex LLM over the in-process paged engine: `PagedLlamaIndexLLM`.

    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM
    llm = PagedLlamaIndexLLM(temperature=0, max_new_tokens=128)  # the embedded SmolLM2
    index.as_query_engine(llm=llm, streaming=True).query("...")

Every instance with the same model and engine settings talks to one shared engine (created
on first use, never at construction), so twenty query engines, agents and coroutines
become one continuously batched stream of work and share one prefix cache. The async
methods await the engine's own queue: they never block the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
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
        LogProb,
        MessageRole,
        TextBlock,
        ToolCallBlock,
    )
    from llama_index.core.bridge.pydantic import Field, PrivateAttr, model_validator
    from llama_index.core.constants import DEFAULT_NUM_OUTPUTS, DEFAULT_TEMPERATURE
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.core.llms.llm import ToolSelection
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'PagedLlamaIndexLLM needs llama-index-core: pip install "pagedllm[llama-index]"'
    ) from error

from .engine.async_engine import AsyncEngine, shared_engine
from .engine.config import EngineConfig
from .engine.outputs import RequestOutput
from .engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools.types import BaseTool

logger = logging.getLogger(__name__)

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
_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}


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
            model_name = self._config.served_model_name or (
                Path(self.model).name if self.model else _DEFAULT_MODEL_NAME
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
        values["stop"] = [*(self.stop or []), *_as_list(values.get("stop"))]
        if kwargs.get("structured_outputs") is not None:
            values["structured_outputs"] = kwargs["structured_outputs"]
        if values.get("n", 1) != 1:
            raise ValueError("n must be 1 here: LlamaIndex takes one answer; call again for more")
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return SamplingParams.from_kwargs(output_kind=kind, **values)

    def _chat_request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], stream: bool
    ) -> tuple[dict[str, Any] | str, SamplingParams, list[dict] | None]:
        """The prompt for a conversation, its sampling params and the tools it offers."""
        tools = kwargs.get("tools") or None
        tool_choice = kwargs.get("tool_choice")
        params = self._sampling_params(kwargs, stream)
        if self.messages_to_prompt is not generic_messages_to_prompt:
            # The user's own formatting wins over the model's chat template.
            return self.messages_to_prompt(messages), params, tools
        from .engine.tool_calls import render_chat_prompt, tool_call_constraint

        tokenizer = self.engine.tokenizer
        text = render_chat_prompt(
            tokenizer, to_openai_messages(messages), tools=tools, tool_choice=tool_choice
        )
        if tools and params.structured_outputs is None:
            constraint = tool_call_constraint(
                tools, tool_choice, parallel_tool_calls=bool(kwargs.get("parallel_tool_calls"))
            )
            if constraint is not None:
                params = params.clone(structured_outputs=constraint)
        # The template already holds any BOS token: the tokenizer must not add another.
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return {"prompt_token_ids": ids}, params, tools

    def _completion_request(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any], stream: bool
    ) -> tuple[str, SamplingParams]:
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        return prompt, self._sampling_params(kwargs, stream)

    # -------------------------------------------------------------- completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text_prompt, params = self._completion_request(prompt, formatted, kwargs, stream=False)
        final = _last(self.engine.generate_sync(text_prompt, params))
        return _completion_response(final)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        text_prompt, params = self._completion_request(prompt, formatted, kwargs, stream=True)
        outputs = self.engine.generate_sync(text_prompt, params)
        return _stream_completions(iter(outputs))

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        engine = await self._aengine()
        text_prompt, params = self._completion_request(prompt, formatted, kwargs, stream=False)
        return _completion_response(await _alast(engine.generate(text_prompt, params)))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        engine = await self._aengine()
        text_prompt, params = self._completion_request(prompt, formatted, kwargs, stream=True)
        return _astream_completions(engine.generate(text_prompt, params))

    # -------------------------------------------------------------------- chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, params, tools = self._chat_request(messages, kwargs, stream=False)
        final = _last(self.engine.generate_sync(prompt, params))
        return _chat_response(final, tools)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, params, tools = self._chat_request(messages, kwargs, stream=True)
        outputs = self.engine.generate_sync(prompt, params)

        def gen() -> ChatResponseGen:
            deltas = _Deltas()
            for output in outputs:
                yield _chat_response(output, tools, deltas)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        engine = await self._aengine()
        prompt, params, tools = self._chat_request(messages, kwargs, stream=False)
        return _chat_response(await _alast(engine.generate(prompt, params)), tools)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        engine = await self._aengine()
        prompt, params, tools = self._chat_request(messages, kwargs, stream=True)
        outputs = engine.generate(prompt, params)

        async def gen() -> ChatResponseAsyncGen:
            deltas = _Deltas()
            async for output in outputs:
                yield _chat_response(output, tools, deltas)

        return gen()

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
        if allow_parallel_tool_calls:
            return response
        # One call was asked for: keep the first, as OpenAI-style integrations do.
        calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if len(calls) > 1:
            response.message.blocks = [
                b for b in response.message.blocks if not isinstance(b, ToolCallBlock)
            ] + calls[:1]
            response.message.additional_kwargs["tool_calls"] = response.message.additional_kwargs[
                "tool_calls"
            ][:1]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        selections = [
            ToolSelection(
                tool_id=block.tool_call_id or f"call_{uuid.uuid4().hex[:12]}",
                tool_name=block.tool_name,
                tool_kwargs=_as_kwargs(block.tool_kwargs),
            )
            for block in response.message.blocks
            if isinstance(block, ToolCallBlock)
        ]
        if not selections:
            for call in response.message.additional_kwargs.get("tool_calls") or []:
                function = call["function"]
                selections.append(
                    ToolSelection(
                        tool_id=call.get("id") or f"call_{uuid.uuid4().hex[:12]}",
                        tool_name=function["name"],
                        tool_kwargs=_as_kwargs(function.get("arguments") or {}),
                    )
                )
        if not selections and error_on_no_tool_call:
            raise ValueError(
                f"expected at least one tool call, but the model answered with text: "
                f"{(response.message.content or '')[:200]!r}"
            )
        return selections

    # ------------------------------------------------------- structured output
    def _structured_messages(
        self, output_cls: type, prompt: PromptTemplate, llm_kwargs: dict | None, prompt_args: dict
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        messages = self._get_messages(prompt, **prompt_args)
        kwargs = dict(llm_kwargs or {})
        kwargs["structured_outputs"] = StructuredOutputsParams(json=output_cls.model_json_schema())
        return messages, kwargs

    def structured_predict(
        self,
        output_cls: type,
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Any:
        """An `output_cls` instance, decoded under the constraint of its JSON schema."""
        messages, kwargs = self._structured_messages(output_cls, prompt, llm_kwargs, prompt_args)
        response = self.chat(messages, **kwargs)
        return output_cls.model_validate_json(response.message.content or "")

    async def astructured_predict(
        self,
        output_cls: type,
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Any:
        messages, kwargs = self._structured_messages(output_cls, prompt, llm_kwargs, prompt_args)
        response = await self.achat(messages, **kwargs)
        return output_cls.model_validate_json(response.message.content or "")


# ---------------------------------------------------------------- conversions
def to_openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex messages as OpenAI chat dicts (what chat templates and tool_calls read)."""
    converted = []
    for message in messages:
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        role = _ROLES.get(role, role)
        texts, calls = [], []
        for block in message.blocks:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolCallBlock):
                calls.append(
                    {
                        "id": block.tool_call_id or f"call_{uuid.uuid4().hex[:12]}",
                        "type": "function",
                        "function": {"name": block.tool_name, "arguments": _as_json(block)},
                    }
                )
            elif block.block_type in ("image", "audio", "video", "document"):
                raise ValueError(
                    f"a {block.block_type} block was given, but pagedllm serves text-only "
                    "models: send text"
                )
            # Thinking blocks, cache points and citations carry nothing for the template.
        entry: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            calls = calls or [
                _openai_call(c) for c in message.additional_kwargs.get("tool_calls") or []
            ]
            if calls:
                entry["tool_calls"] = calls
        if role == "tool":
            entry["tool_call_id"] = message.additional_kwargs.get("tool_call_id")
            if "name" in message.additional_kwargs:
                entry["name"] = message.additional_kwargs["name"]
        converted.append(entry)
    return converted


def _openai_call(call: Any) -> dict[str, Any]:
    if hasattr(call, "model_dump"):  # an OpenAI SDK object
        call = call.model_dump()
    function = dict(call["function"])
    if not isinstance(function.get("arguments"), str):
        function["arguments"] = json.dumps(function.get("arguments") or {})
    return {"id": call.get("id"), "type": "function", "function": function}


def _as_json(block: ToolCallBlock) -> str:
    kwargs = block.tool_kwargs
    return kwargs if isinstance(kwargs, str) else json.dumps(kwargs)


def _as_kwargs(arguments: dict | str) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _as_list(stop: list[str] | str | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _last(outputs: Iterator[RequestOutput]) -> RequestOutput:
    final = None
    for output in outputs:
        final = output
    assert final is not None, "a request always ends with a final output"
    return final


async def _alast(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in outputs:
        final = output
    assert final is not None, "a request always ends with a final output"
    return final


def _raw(output: RequestOutput, generated: int) -> dict[str, Any]:
    """The request's id, and once it ends: finish reason, token usage, prefix-cache hits."""
    raw: dict[str, Any] = {"request_id": output.request_id}
    if output.finished:
        prompt_tokens = len(output.prompt_token_ids)
        raw["finish_reason"] = output.outputs[0].finish_reason
        raw["num_cached_tokens"] = output.num_cached_tokens
        raw["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
        }
    return raw


def _logprobs(output: RequestOutput) -> list[list[LogProb]] | None:
    entries = output.outputs[0].logprobs
    if entries is None:
        return None
    return [
        [
            LogProb(token=lp.decoded_token or "", logprob=lp.logprob)
            for lp in sorted(position.values(), key=lambda lp: lp.rank)
        ]
        for position in entries
    ]


class _Deltas:
    """Adds up a DELTA stream: the text so far and how many tokens were generated."""

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0

    def add(self, output: RequestOutput) -> str:
        completion = output.outputs[0]
        self.text += completion.text
        self.num_tokens += len(completion.token_ids)
        return completion.text


def _completion_response(output: RequestOutput) -> CompletionResponse:
    completion = output.outputs[0]
    return CompletionResponse(
        text=completion.text,
        raw=_raw(output, len(completion.token_ids)),
        logprobs=_logprobs(output),
    )


def _completion_chunk(output: RequestOutput, deltas: _Deltas) -> CompletionResponse:
    delta = deltas.add(output)
    return CompletionResponse(
        text=deltas.text,
        delta=delta,
        raw=_raw(output, deltas.num_tokens),
        logprobs=_logprobs(output),
    )


def _stream_completions(outputs: Iterator[RequestOutput]) -> CompletionResponseGen:
    deltas = _Deltas()
    for output in outputs:
        yield _completion_chunk(output, deltas)


async def _astream_completions(outputs: AsyncIterator[RequestOutput]) -> CompletionResponseAsyncGen:
    deltas = _Deltas()
    async for output in outputs:
        yield _completion_chunk(output, deltas)


def _chat_response(
    output: RequestOutput,
    tools: list[dict] | None,
    deltas: _Deltas | None = None,
) -> ChatResponse:
    """An assistant message; once the request ends with tools on offer, its tool calls."""
    if deltas is None:
        text, delta, generated = output.outputs[0].text, None, len(output.outputs[0].token_ids)
    else:
        delta = deltas.add(output)
        text, generated = deltas.text, deltas.num_tokens
    additional: dict[str, Any] = {}
    blocks: list[Any] = []
    if tools and output.finished:
        from .engine.tool_calls import parse_tool_calls

        text, calls = parse_tool_calls(text, tools)
        blocks = [
            ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments)
            for c in calls
        ]
        if calls:
            additional["tool_calls"] = [c.to_openai() for c in calls]
    message = ChatMessage(
        role=MessageRole.ASSISTANT,
        blocks=[TextBlock(text=text), *blocks],
        additional_kwargs=additional,
    )
    return ChatResponse(
        message=message, delta=delta, raw=_raw(output, generated), logprobs=_logprobs(output)
    )
