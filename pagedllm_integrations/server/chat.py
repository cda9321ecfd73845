"""POST /v1/chat/completions: the chat layer (chat/) behind OpenAI's request and response
shapes. With tools on offer, a stream holds back only the text that may be a tool call
(the chat layer's gate); OpenAI's clients expect a call as `tool_calls`, never as content.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.logprobs import chat_logprobs
from ..chat.outputs import ChatChoice, Usage, read_choice
from ..chat.prepare import ChatOptions, ChatPrompt, prepare_chat
from ..chat.stream import ChoiceStream
from ..chat.tool_choice import ToolPlan
from ..engine.output_processor import RequestGroup
from ..engine.request_limits import check_schema
from .errors import APIError, sse_error
from .protocol import ChatCompletionRequest, ChatMessage
from .sampling import build_sampling_params, response_format_constraint
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
    return out


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    if isinstance(arguments, str):
        return arguments
    try:  # json.dumps recurses on the depth the client chose
        check_schema(arguments, "tool call arguments")
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None
    return json.dumps(arguments)


def _prepare(state: ServerState, body: ChatCompletionRequest, params) -> ChatPrompt:
    """The conversation rendered, tokenized, its tools planned (off the event loop)."""
    choice = body.tool_choice
    options = ChatOptions(
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        tool_choice=choice if choice is None or isinstance(choice, str) else choice.model_dump(),
        structured=response_format_constraint(body.response_format),
        parallel_tool_calls=bool(body.parallel_tool_calls),
    )
    messages = [_message_dict(m) for m in body.messages]
    return prepare_chat(
        state.engine, messages, params, options, split_special_tokens=body.split_special_tokens
    )


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, request: Request
) -> Response:
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    params = build_sampling_params(
        state.engine.model_info,
        body,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        stream=body.stream,
    )
    response_id = new_id("chatcmpl")
    prepared: list[ChatPrompt] = []

    def make_groups() -> list[RequestGroup]:
        prompt = _prepare(state, body, params)
        prepared.append(prompt)
        group = state.make_group(
            prompt.engine_prompt, prompt.params, response_id, body.cache_salt,
            max_tokens_given=max_tokens is not None,
        )  # fmt: skip
        return [group]

    try:
        call = await state.start(request, body.n, make_groups)
    except ClientGone:
        return Response(status_code=499)
    plan = prepared[0].plan
    if body.stream:
        return StreamingResponse(
            _stream(state, body, call, response_id, plan), media_type="text/event-stream"
        )
    try:
        (final,) = await finals_unless_disconnected(request, call)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for output in sorted(final.outputs, key=lambda o: o.index):
        read = read_choice(output.text, output.finish_reason, plan)
        choices.append(
            {
                "index": output.index,
                "message": _message(read),
                "logprobs": _logprobs(body, output.token_ids, output.logprobs),
                "finish_reason": read.finish_reason,
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
            "usage": Usage.of([final]).to_openai(state.limits.report_cached_tokens),
            "system_fingerprint": None,
        }
    )


def _message(choice: ChatChoice) -> dict[str, Any]:
    """The assistant message of one choice: content, and the tool calls read from it."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": choice.content if choice.content or not choice.tool_calls else None,
    }
    if choice.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in choice.tool_calls]
    return message


def _logprobs(body: ChatCompletionRequest, token_ids, entries) -> dict[str, Any] | None:
    if not body.logprobs or entries is None:
        return None
    return {"content": chat_logprobs(list(token_ids), list(entries), body.top_logprobs or 0)}


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    call: EngineCall,
    response_id: str,
    plan: ToolPlan,
) -> AsyncIterator[str]:
    created = int(time.time())
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options is not None and options.continuous_usage_stats
    report_cached = state.limits.report_cached_tokens
    choices = [ChoiceStream(plan) for _ in range(body.n)]
    started = [False] * body.n
    usage = Usage()

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
            payload["usage"] = usage.to_openai(report_cached) if continuous else None
        return sse(payload)

    try:
        async for _, out in call:
            for output in out.outputs:
                stream = choices[output.index]
                if stream.finished:
                    continue
                step = stream.feed(output)
                usage = Usage.of([out], completion_tokens=sum(c.num_tokens for c in choices))
                if not started[output.index]:
                    started[output.index] = True
                    yield chunk(output.index, {"role": "assistant", "content": ""})
                held = stream.gate is not None  # text that may be a call waits for the end
                if step.done is None and not step.text and (held or not output.token_ids):
                    continue
                delta: dict[str, Any] = {"content": step.text} if step.text else {}
                if step.done is not None and step.done.tool_calls:
                    delta["tool_calls"] = [
                        {"index": i, **c.to_openai()} for i, c in enumerate(step.done.tool_calls)
                    ]
                yield chunk(
                    output.index,
                    delta,
                    finish_reason=step.done.finish_reason if step.done is not None else None,
                    logprobs=_logprobs(body, output.token_ids, output.logprobs),
                    stop_reason=output.stop_reason,
                )
        if include_usage:
            payload = {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": usage.to_openai(report_cached),
            }
            yield sse(payload)
        yield SSE_DONE
    except Exception as error:  # the 200 is already out: report in the stream
        yield sse_error(error, f"chat stream {response_id}")
        yield SSE_DONE
    finally:
        call.close()
