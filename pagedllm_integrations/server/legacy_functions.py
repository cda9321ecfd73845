"""OpenAI's legacy function calling (`functions`, `function_call`) on top of tools.

`functions` are tools; `function_call` is the tool choice ("none", "auto", or {"name"},
which forces that call by constrained decoding, as a named tool_choice does). The answer
comes back in the legacy shape: `message.function_call` and finish_reason "function_call"
(one call: the legacy API has no parallel calls). In the history, an assistant turn's
`function_call` is a tool call and a "function" message is its result.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .errors import APIError
from .protocol import ChatCompletionRequest


def tools_and_choice(body: ChatCompletionRequest) -> tuple[list[dict] | None, Any, bool]:
    """(tools, tool_choice, legacy) for the chat layer; legacy: the request used functions."""
    if body.functions is None:
        if body.function_call is not None:
            raise APIError(400, "function_call needs functions", param="function_call")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice
        return (
            tools,
            choice if choice is None or isinstance(choice, str) else choice.model_dump(),
            False,
        )
    if body.tools is not None or body.tool_choice is not None:
        raise APIError(
            400,
            "functions and function_call are the legacy form of tools and tool_choice; give "
            "one form, not both",
            param="functions",
        )
    if body.parallel_tool_calls:
        raise APIError(400, "legacy function calling makes one call; use tools for parallel "
                       "calls", param="parallel_tool_calls")  # fmt: skip
    tools = [
        {"type": "function", "function": f.model_dump(exclude_none=True)} for f in body.functions
    ]
    call = body.function_call
    if call is None or isinstance(call, str):
        return tools, call, True
    return tools, {"type": "function", "function": {"name": call.name}}, True


def history_message(message: dict[str, Any], function_call: Any) -> dict[str, Any]:
    """A legacy message as the chat layer takes it: a "function" result as a tool result,
    an assistant's `function_call` as its tool call."""
    if message["role"] == "function":
        return {**message, "role": "tool"}
    if function_call is not None and not message.get("tool_calls"):
        arguments = function_call.arguments
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": function_call.name, "arguments": arguments},
        }
        return {**message, "tool_calls": [call]}
    return message


def legacy_message(message: dict[str, Any], finish_reason: str | None) -> tuple[dict, str | None]:
    """A response message with tool calls in the legacy shape: its first call as
    `function_call`, finish_reason "function_call"."""
    calls = message.pop("tool_calls", None)
    if not calls:
        return message, finish_reason
    message["function_call"] = dict(calls[0]["function"])
    return message, "function_call" if finish_reason == "tool_calls" else finish_reason
