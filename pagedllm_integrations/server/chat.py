"""POST /v1/chat/completions: chat template, tools, response_format, streaming deltas.

With tools in play (tools given and tool_choice not "none") a stream holds each choice's
text back until it ends: whether the text is a tool call is only known once it is complete,
and OpenAI's clients expect a call as `tool_calls`, never as content.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .errors import APIError, sse_error
from .protocol import ChatCompletionRequest, ChatMessage
from .sampling import build_sampling_params, chat_logprobs, response_format_constraint, usage
from .serving import (
    SSE_DONE,
    ClientGone,
    EngineCall,
    ServerState,
    finals_unless_disconnected,
    new_id,
    sse,
)


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": call.function.arguments
                    if isinstance(call.function.arguments, str)
                    else json.dumps(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _tool_choice(body: ChatCompletionRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _render(state: ServerState, messages: list[dict], tools: list | None, choice: Any) -> list[int]:
    """Chat template -> token ids (any BOS is in the template, so none is added)."""
    tokenizer = state.engine.tokenizer
    try:
        if tools:
            from ..engine.tool_calls import render_chat_prompt

            text = render_chat_prompt(tokenizer, messages, tools=tools, tool_choice=choice)
        else:
            text = state.engine.apply_chat_template(messages)
    except (TemplateError, TypeError, KeyError, IndexError) as error:
        # A template refusing this conversation (jinja's raise_exception, or a message shape
        # it indexes into): the conversation came from the client.
        raise APIError(400, f"the chat template rejected the messages: {error}",
                       param="messages") from error  # fmt: skip
    return list(tokenizer(text, add_special_tokens=False).input_ids)


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    state.check_model(body.model)
    choice = _tool_choice(body)
    tools = None
    if body.tools and choice != "none":
        from ..engine.tool_calls import normalize_tools

        tools = normalize_tools([t.model_dump(exclude_none=True) for t in body.tools])
    elif choice not in ("none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    structured = response_format_constraint(body.response_format)
    if tools:
        from ..engine.tool_calls import tool_call_constraint

        forced = tool_call_constraint(tools, choice)
        if forced is not None and structured is not None:
            raise APIError(400, "a required tool call and response_format cannot both constrain "
                           "the output; drop one", param="response_format")  # fmt: skip
        structured = forced or structured
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        vocab_size=state.engine.model_info.vocab_size,
        stream=body.stream,
        structured=structured,
    )
    messages = [_message_dict(m) for m in body.messages]
    ids = await asyncio.to_thread(_render, state, messages, tools, choice)
    response_id = new_id("chatcmpl")
    call = await state.start([{"prompt_token_ids": ids}], params, response_id)
    if body.stream:
        return StreamingResponse(
            _stream(state, body, call, response_id, tools), media_type="text/event-stream"
        )
    try:
        (final,) = await finals_unless_disconnected(request, call)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for output in sorted(final.outputs, key=lambda o: o.index):
        message, finish_reason = _message(output.text, output.finish_reason, tools)
        choices.append(
            {
                "index": output.index,
                "message": message,
                "logprobs": _logprobs(body, output.token_ids, output.logprobs),
                "finish_reason": finish_reason,
                "stop_reason": output.stop_reason,
            }
        )
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": usage(
                len(final.prompt_token_ids),
                sum(len(o.token_ids) for o in final.outputs),
                final.num_cached_tokens,
            ),
            "system_fingerprint": None,
        }
    )


def _message(text: str, finish_reason: str | None, tools: list | None):
    """The assistant message of one choice, with any tool calls parsed out of its text."""
    calls = []
    if tools:
        from ..engine.tool_calls import parse_tool_calls

        text, calls = parse_tool_calls(text, tools)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in calls
        ]
        finish_reason = "tool_calls"
    return message, finish_reason


def _logprobs(body: ChatCompletionRequest, token_ids, entries) -> dict[str, Any] | None:
    if not body.logprobs or entries is None:
        return None
    return {"content": chat_logprobs(list(token_ids), list(entries), body.top_logprobs or 0)}


@dataclass(slots=True)
class _Choice:
    """What a stream has seen of one choice."""

    started: bool = False
    ended: bool = False
    generated: int = 0
    text: list[str] = field(default_factory=list)  # held back while tools are in play
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    call: EngineCall,
    response_id: str,
    tools: list | None,
) -> AsyncIterator[str]:
    created = int(time.time())
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options is not None and options.continuous_usage_stats
    choices = [_Choice() for _ in range(body.n)]
    prompt_tokens = cached = 0

    def chunk(index: int, delta: dict, finish_reason=None, logprobs=None, stop_reason=None) -> str:
        payload: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                }
            ],
        }
        if include_usage:
            generated = sum(c.generated for c in choices)
            payload["usage"] = usage(prompt_tokens, generated, cached) if continuous else None
        return sse(payload)

    try:
        async for _, out in call:
            prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
            for output in out.outputs:
                state_ = choices[output.index]
                state_.generated += len(output.token_ids)
                if state_.ended:
                    continue
                if not state_.started:
                    state_.started = True
                    yield chunk(output.index, {"role": "assistant", "content": ""})
                finished = output.finish_reason is not None
                if tools:  # hold back until the choice is complete
                    state_.text.append(output.text)
                    state_.token_ids.extend(output.token_ids)
                    state_.logprobs.extend(output.logprobs or [])
                    if not finished:
                        continue
                    message, reason = _message("".join(state_.text), output.finish_reason, tools)
                    delta: dict[str, Any] = {}
                    if message["content"]:
                        delta["content"] = message["content"]
                    if "tool_calls" in message:
                        delta["tool_calls"] = [
                            {"index": i, **tc} for i, tc in enumerate(message["tool_calls"])
                        ]
                    token_ids, entries = state_.token_ids, state_.logprobs
                else:
                    if not output.text and not output.token_ids and not finished:
                        continue
                    delta = {"content": output.text} if output.text else {}
                    reason = output.finish_reason
                    token_ids, entries = output.token_ids, output.logprobs
                state_.ended = finished
                yield chunk(
                    output.index,
                    delta,
                    finish_reason=reason,
                    logprobs=_logprobs(body, token_ids, entries),
                    stop_reason=output.stop_reason,
                )
        if include_usage:
            payload = {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": usage(prompt_tokens, sum(c.generated for c in choices), cached),
            }
            yield sse(payload)
        yield SSE_DONE
    except Exception as error:  # the 200 is already out: report in the stream
        yield sse_error(error)
        yield SSE_DONE
    finally:
        call.close()
