"""Conversions for PagedLlamaIndexLLM: LlamaIndex messages to OpenAI chat dicts (what the chat
template and the tool-call code read), engine outputs to LlamaIndex responses, and the
streams between them (abandoning one aborts its request)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    LogProb,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.program.utils import process_streaming_objects

from .engine.async_engine import AsyncEngine, RequestStream
from .engine.outputs import RequestOutput
from .engine.tool_calls import new_call_id, parse_tool_calls

# LlamaIndex roles that chat templates know under another name.
_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}
_NON_TEXT_BLOCKS = ("image", "audio", "video", "document")


# ------------------------------------------------------------------- messages in
def to_openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex messages as OpenAI chat dicts; tool calls from ToolCallBlocks (or the older
    additional_kwargs["tool_calls"]), tool results with their tool_call_id."""
    converted = []
    for message in messages:
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        role = _ROLES.get(role, role)
        texts, calls = [], []
        for block in message.blocks:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolCallBlock):
                arguments = block.tool_kwargs
                calls.append(
                    {
                        "id": block.tool_call_id or new_call_id(),
                        "type": "function",
                        "function": {
                            "name": block.tool_name,
                            "arguments": arguments
                            if isinstance(arguments, str)
                            else json.dumps(arguments),
                        },
                    }
                )
            elif block.block_type in _NON_TEXT_BLOCKS:
                raise ValueError(
                    f"a message holds a {block.block_type} block, but pagedllm serves "
                    "text-only models: send text"
                )
            # Thinking blocks, cache points and citations carry nothing for the template.
        entry: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            legacy = message.additional_kwargs.get("tool_calls") or []
            calls = calls or [_openai_call(call) for call in legacy]
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
    return {"id": call.get("id") or new_call_id(), "type": "function", "function": function}


# ------------------------------------------------------------------ tool calls out
def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    """The tool calls of an assistant message, from its blocks or additional_kwargs."""
    selections = [
        ToolSelection(
            tool_id=block.tool_call_id or new_call_id(),
            tool_name=block.tool_name,
            tool_kwargs=_as_kwargs(block.tool_kwargs),
        )
        for block in message.blocks
        if isinstance(block, ToolCallBlock)
    ]
    if selections:
        return selections
    for call in message.additional_kwargs.get("tool_calls") or []:
        call = _openai_call(call)
        selections.append(
            ToolSelection(
                tool_id=call["id"],
                tool_name=call["function"]["name"],
                tool_kwargs=_as_kwargs(call["function"]["arguments"]),
            )
        )
    return selections


def keep_first_tool_call(message: ChatMessage) -> None:
    """Drop every tool call after the first (when parallel calls were not allowed)."""
    calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if len(calls) > 1:
        message.blocks = [b for b in message.blocks if not isinstance(b, ToolCallBlock)]
        message.blocks.append(calls[0])
        message.additional_kwargs["tool_calls"] = message.additional_kwargs["tool_calls"][:1]


def _as_kwargs(arguments: dict | str) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


# ----------------------------------------------------------------- responses out
class Deltas:
    """Adds up a DELTA stream: the text so far and how many tokens were generated."""

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0

    def add(self, output: RequestOutput) -> str:
        completion = output.outputs[0]
        self.text += completion.text
        self.num_tokens += len(completion.token_ids)
        return completion.text


def raw_info(output: RequestOutput, generated: int) -> dict[str, Any]:
    """`raw` of a response: the request id, and once it ends: finish reason, token usage
    (OpenAI's names) and the prompt tokens the prefix cache served."""
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


def completion_response(output: RequestOutput, deltas: Deltas | None = None) -> CompletionResponse:
    """A whole completion (deltas None) or one streamed chunk of it."""
    if deltas is None:
        completion = output.outputs[0]
        text, delta, generated = completion.text, None, len(completion.token_ids)
    else:
        delta = deltas.add(output)
        text, generated = deltas.text, deltas.num_tokens
    return CompletionResponse(
        text=text, delta=delta, raw=raw_info(output, generated), logprobs=_logprobs(output)
    )


def chat_response(
    output: RequestOutput,
    tools: list[dict] | None,
    deltas: Deltas | None = None,
    tool_format: Any = None,
) -> ChatResponse:
    """An assistant message (whole, or one streamed chunk). When tools were on offer, the
    final one carries the parsed calls as ToolCallBlocks and as OpenAI-style
    additional_kwargs["tool_calls"], and its text is what is left besides them."""
    if deltas is None:
        completion = output.outputs[0]
        text, delta, generated = completion.text, None, len(completion.token_ids)
    else:
        delta = deltas.add(output)
        text, generated = deltas.text, deltas.num_tokens
    additional: dict[str, Any] = {}
    blocks: list[Any] = []
    if tools and output.finished:
        text, calls = parse_tool_calls(text, tools, tool_format)
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
        message=message, delta=delta, raw=raw_info(output, generated), logprobs=_logprobs(output)
    )


# ------------------------------------------------------------------- streams
class PartialObject:
    """The object so far, parsed from the JSON text streamed so far (fields may be None)."""

    def __init__(self, output_cls: type, llm: Any) -> None:
        self.output_cls, self.llm = output_cls, llm
        self.current: list[Any] | None = None

    def update(self, response: ChatResponse) -> Any:
        obj = process_streaming_objects(
            response, self.output_cls, cur_objects=self.current, flexible_mode=True, llm=self.llm
        )
        self.current = [obj]
        return obj


def follow(engine: AsyncEngine, stream: RequestStream) -> Iterator[RequestOutput]:
    """A request's outputs; abandoning the iterator aborts the request."""
    try:
        yield from stream
    finally:
        if not stream.finished:
            engine.abort(stream.request_id)


async def afollow(engine: AsyncEngine, stream: RequestStream) -> AsyncIterator[RequestOutput]:
    try:
        async for output in stream:
            yield output
    finally:
        if not stream.finished:
            engine.abort(stream.request_id)


def last(outputs: Iterator[RequestOutput]) -> RequestOutput:
    final = None
    for output in outputs:
        final = output
    assert final is not None, "a request always ends with a final output"
    return final


async def alast(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in outputs:
        final = output
    assert final is not None, "a request always ends with a final output"
    return final
