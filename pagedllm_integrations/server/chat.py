"""POST /v1/chat/completions: the chat layer (chat/) behind OpenAI's request and response
shapes, with vLLM's chat extras (add_generation_prompt, continue_final_message, echo,
chat_template, chat_template_kwargs, documents) and OpenAI's legacy `functions`. With tools
on offer, a stream holds back only the text that may be a tool call (the chat layer's gate);
OpenAI's clients expect a call as `tool_calls`, never as content.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..chat.outputs import ChatChoice, Usage, read_choice
from ..chat.prepare import ChatOptions, ChatPrompt, prepare_chat
from ..chat.tool_formats import template_text
from ..engine.engine_request import EngineRequest
from ..engine.request_limits import check_schema
from .chat_stream import choice_logprobs, stream_chat
from .errors import APIError
from .legacy_functions import history_message, legacy_message, tools_and_choice
from .peer_fields import check_fields, check_message_fields
from .protocol import ChatCompletionRequest, ChatMessage
from .requests import check_priority, response_id_of, truncated
from .responses import json_response
from .sampling import build_sampling_params, requested_max_tokens
from .serving import ClientGone, ServerState, finals_unless_disconnected, new_id
from .structured import request_constraint

# Keys apply_chat_template takes itself: a template variable of these names is a 400.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
     "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length"}
)  # fmt: skip


@dataclass(slots=True)
class ChatCall:
    """What the response needs to know about the request beyond its body."""

    response_id: str
    echo: str  # text prepended to each choice's content (vLLM's chat `echo`), or ""
    legacy: bool  # answer tool calls as a legacy `function_call`
    prompt: ChatPrompt | None = None


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments_text(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.function_call is not None:
        _arguments_text(message.function_call.arguments)  # the same bounds as tool calls
    return history_message(out, message.function_call)


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    if isinstance(arguments, str):
        return arguments
    try:  # json.dumps recurses on the depth the client chose
        check_schema(arguments, "tool call arguments")
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None
    return json.dumps(arguments)


def _template_kwargs(state: ServerState, body: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs and documents as template variables. One the template never
    reads would be silently ignored, so it is a 400 (a name it does not mention)."""
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved}: they are request "
                       "fields of their own", param="chat_template_kwargs")  # fmt: skip
    template = body.chat_template or template_text(state.engine.tokenizer)
    unread = [key for key in kwargs if not re.search(rf"\b{re.escape(key)}\b", template)]
    if unread:
        raise APIError(400, f"chat_template_kwargs {unread} are not read by the chat template, "
                       "so they would change nothing", param="chat_template_kwargs")  # fmt: skip
    if body.documents is not None and not re.search(r"\bdocuments\b", template):
        raise APIError(400, "documents are not read by the chat template, so they would "
                       "change nothing", param="documents")  # fmt: skip
    try:
        check_schema(kwargs, "chat_template_kwargs")
        if body.documents is not None:
            check_schema(body.documents, "documents")
    except ValueError as error:
        raise APIError(400, str(error), param="chat_template_kwargs") from None
    if body.documents is not None:
        kwargs["documents"] = body.documents
    if body.continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs


def _generation_prompt(body: ChatCompletionRequest) -> bool:
    """add_generation_prompt, which continue_final_message turns off (both: a 400, as vLLM)."""
    if not body.continue_final_message:
        return body.add_generation_prompt
    if "add_generation_prompt" in body.model_fields_set and body.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be "
                       "true", param="continue_final_message")  # fmt: skip
    if body.messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message needs an assistant message last",
                       param="continue_final_message")  # fmt: skip
    return False


def _echo_text(body: ChatCompletionRequest, generation_prompt: bool) -> str:
    """vLLM's chat echo: the last message's text when the answer continues its role."""
    if not body.echo:
        return ""
    last = body.messages[-1]
    role = "assistant" if generation_prompt else last.role
    return (last.text() or "") if last.role == role else ""


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    check_fields(body, state.limits.allow_unknown_fields)
    check_message_fields(body.messages, state.limits.allow_unknown_fields)
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    given = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    max_tokens, max_given = requested_max_tokens(body, given)
    check_priority(state, body.priority)
    generation_prompt = _generation_prompt(body)
    tools, tool_choice, legacy = tools_and_choice(body)
    constraint = request_constraint(body)
    template_kwargs = _template_kwargs(state, body)
    params = build_sampling_params(
        state.engine.model_info,
        body,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        stream=body.stream,
    )
    call_info = ChatCall(
        response_id_of(body, "chatcmpl"), _echo_text(body, generation_prompt), legacy
    )
    options = ChatOptions(
        tools=tools,
        tool_choice=tool_choice,
        structured=constraint[1] if constraint else None,
        parallel_tool_calls=bool(body.parallel_tool_calls) and not legacy,
    )
    wanted = max_tokens if max_given else None

    def check_rendered(text: str) -> None:  # before tokenizing: can it fit at all?
        if body.truncate_prompt_tokens is None:
            state.prompt_bound.check(len(text), wanted, "messages")

    def make_requests() -> list[EngineRequest]:
        prompt = prepare_chat(
            state.engine, [_message_dict(m) for m in body.messages], params, options,
            add_generation_prompt=generation_prompt, template_kwargs=template_kwargs,
            split_special_tokens=body.split_special_tokens, chat_template=body.chat_template,
            add_special_tokens=bool(body.add_special_tokens), check_rendered=check_rendered,
        )  # fmt: skip
        call_info.prompt = prompt
        ids = truncated(state, prompt.token_ids, body.truncate_prompt_tokens, wanted)
        engine_request = state.make_request(
            {"prompt_token_ids": ids}, prompt.params, new_id("chat"), body.cache_salt,
            max_tokens_given=max_given, priority=body.priority,
            constraint_param=constraint[0] if constraint else "tools",
        )  # fmt: skip
        return [engine_request]

    try:
        call = await state.start(request, body.n, make_requests, user=body.user)
    except ClientGone:
        return Response(status_code=499)
    assert call_info.prompt is not None
    if body.stream:
        return StreamingResponse(
            stream_chat(state, body, call, call_info.response_id, call_info.prompt.plan,
                        call_info.echo, call_info.legacy),
            media_type="text/event-stream",
        )  # fmt: skip
    try:
        (final,) = await finals_unless_disconnected(request, call)
    except ClientGone:
        return Response(status_code=499)
    plan = call_info.prompt.plan

    def build() -> dict[str, Any]:
        choices = []
        for output in sorted(final.outputs, key=lambda o: o.index):
            read = read_choice(output.text, output.finish_reason, plan)
            message, finish_reason = _message(read, call_info.echo), read.finish_reason
            if call_info.legacy:
                message, finish_reason = legacy_message(message, finish_reason)
            choices.append(
                {
                    "index": output.index,
                    "message": message,
                    "logprobs": choice_logprobs(body, output.token_ids, output.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": output.stop_reason,
                }
            )
        return {
            "id": call_info.response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": Usage.of([final]).to_openai(state.limits.report_cached_tokens),
            "system_fingerprint": None,
        }

    return await json_response(build)


def _message(choice: ChatChoice, echo: str = "") -> dict[str, Any]:
    """The assistant message of one choice: content, and the tool calls read from it."""
    content = choice.content if choice.content or not choice.tool_calls else None
    if echo:
        content = echo + (content or "")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if choice.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in choice.tool_calls]
    return message
