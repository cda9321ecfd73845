"""The server-sent events of a streamed chat completion."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from ..chat.logprobs import chat_logprobs
from ..chat.outputs import Usage
from ..chat.stream import ChoiceStream
from ..chat.tool_choice import ToolPlan
from .errors import sse_error
from .protocol import ChatCompletionRequest
from .serving import SSE_DONE, EngineCall, ServerState, sse


async def stream_chat(
    state: ServerState,
    body: ChatCompletionRequest,
    call: EngineCall,
    response_id: str,
    plan: ToolPlan,
    echo: str = "",
    legacy: bool = False,
) -> AsyncIterator[str]:
    """echo: text the first chunk of each choice carries (vLLM's chat `echo`); legacy: tool
    calls as a legacy `function_call` delta, finish_reason "function_call"."""
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
                    yield chunk(output.index, {"role": "assistant", "content": echo})
                held = stream.gate is not None  # text that may be a call waits for the end
                if step.done is None and not step.text and (held or not output.token_ids):
                    continue
                delta: dict[str, Any] = {"content": step.text} if step.text else {}
                finish_reason = step.done.finish_reason if step.done is not None else None
                if step.done is not None and step.done.tool_calls:
                    calls = [c.to_openai() for c in step.done.tool_calls]
                    if legacy:
                        delta["function_call"] = dict(calls[0]["function"])
                        if finish_reason == "tool_calls":
                            finish_reason = "function_call"
                    else:
                        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                yield chunk(
                    output.index,
                    delta,
                    finish_reason=finish_reason,
                    logprobs=choice_logprobs(body, output.token_ids, output.logprobs),
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


def choice_logprobs(body: ChatCompletionRequest, token_ids, entries) -> dict[str, Any] | None:
    if not body.logprobs or entries is None:
        return None
    return {"content": chat_logprobs(list(token_ids), list(entries), body.top_logprobs or 0)}
