"""Conversions for PagedLlamaIndexLLM: LlamaIndex messages to OpenAI chat dicts (what the chat
layer reads), and the chat layer's reading of engine outputs to LlamaIndex responses."""

from __future__ import annotations

import json
from collections.abc import Sequence
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

from .chat.chat_messages import not_text_message
from .chat.logprobs import chat_logprobs
from .chat.outputs import ChatChoice, Usage, check_complete, read_choice
from .chat.stream import ChoiceStream
from .chat.tool_calls import new_call_id
from .chat.tool_choice import ToolPlan
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams

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
                raise ValueError(not_text_message(block.block_type))
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
class CallState:
    """One call's settings and tool plan, and for a stream the choice being streamed."""

    def __init__(self, params: SamplingParams, plan: ToolPlan):
        self.params = params
        self.plan = plan
        self.stream = ChoiceStream(plan)

    def check(self, choice: ChatChoice, finish_reason: str | None, num_tokens: int) -> None:
        """IncompleteOutputError when a forced call / structured output was cut off."""
        check_complete(self.plan, choice, finish_reason, num_tokens, self.params.max_tokens)


def raw_info(output: RequestOutput, finish_reason: str | None, generated: int) -> dict[str, Any]:
    """`raw` of a response: the request id, and once it ends: finish reason, token usage
    (OpenAI's names) and the prompt tokens the prefix cache served."""
    raw: dict[str, Any] = {"request_id": output.request_id}
    if output.finished:
        usage = Usage.of([output], completion_tokens=generated)
        raw["finish_reason"] = finish_reason
        raw["num_cached_tokens"] = usage.cached_tokens
        raw["usage"] = usage.to_openai()
    return raw


def _logprobs(completion: CompletionOutput, top: int | None) -> list[list[LogProb]] | None:
    """Per token: the top candidates (or the sampled token alone when none were asked)."""
    if completion.logprobs is None or top is None:
        return None
    return [
        [LogProb(token=t["token"], logprob=t["logprob"]) for t in position["top_logprobs"]]
        or [LogProb(token=position["token"], logprob=position["logprob"])]
        for position in chat_logprobs(completion.token_ids, completion.logprobs, top)
    ]


def completion_response(
    output: RequestOutput, call: CallState, streaming: bool = False
) -> CompletionResponse:
    """A whole completion or one streamed chunk of it."""
    completion = output.outputs[0]
    stream = call.stream if streaming else None
    if stream is None:
        text, delta, generated = completion.text, None, len(completion.token_ids)
    else:
        delta = stream.feed(completion).text
        text, generated = stream.content, stream.num_tokens
    if output.finished:
        call.check(ChatChoice(text), completion.finish_reason, generated)
    return CompletionResponse(
        text=text,
        delta=delta,
        raw=raw_info(output, completion.finish_reason, generated),
        logprobs=_logprobs(completion, call.params.logprobs),
    )


def chat_response(output: RequestOutput, call: CallState, streaming: bool = False) -> ChatResponse:
    """An assistant message (whole, or one streamed chunk). When tools were on offer, the
    final one carries the parsed calls as ToolCallBlocks and as OpenAI-style
    additional_kwargs["tool_calls"], and its text is what is left besides them; while
    streaming, text that may be a call is held back until the end."""
    completion = output.outputs[0]
    stream = call.stream if streaming else None
    if stream is None:
        choice = read_choice(completion.text, completion.finish_reason, call.plan)
        delta, generated = None, len(completion.token_ids)
    else:
        step = stream.feed(completion)
        delta, generated = step.text, stream.num_tokens
        choice = step.done or ChatChoice(stream.content)
    if output.finished:
        call.check(choice, completion.finish_reason, generated)
    additional: dict[str, Any] = {}
    if choice.tool_calls:
        additional["tool_calls"] = [c.to_openai() for c in choice.tool_calls]
    blocks = [
        ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments)
        for c in choice.tool_calls
    ]
    message = ChatMessage(
        role=MessageRole.ASSISTANT,
        blocks=[TextBlock(text=choice.content), *blocks],
        additional_kwargs=additional,
    )
    return ChatResponse(
        message=message,
        delta=delta,
        raw=raw_info(output, choice.finish_reason, generated),
        logprobs=_logprobs(completion, call.params.logprobs),
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
