"""LangChain messages -> OpenAI chat dicts, the form the chat layer takes. Pure Python: no
engine, no model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .chat.chat_messages import not_text_message


def message_text(content: Any) -> str:
    """Plain text of a message's content (a string or a list of content blocks)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            kind = block.get("type")
            if kind == "text":
                parts.append(block.get("text", ""))
            elif kind in ("image", "image_url", "audio", "input_audio", "file", "video"):
                raise ValueError(not_text_message(kind))
            # tool_use / thinking / reasoning blocks: the tool calls travel in tool_calls.
    return "".join(parts)


def to_openai_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """LangChain messages -> OpenAI chat dicts (what `chat.prepare` renders)."""
    from langchain_core.messages import (
        AIMessage,
        ChatMessage,
        FunctionMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )

    result: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            result.append({"role": "system", "content": message_text(message.content)})
        elif isinstance(message, HumanMessage):
            result.append({"role": "user", "content": message_text(message.content)})
        elif isinstance(message, AIMessage):
            entry: dict[str, Any] = {
                "role": "assistant",
                "content": message_text(message.content),
            }
            if message.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": call.get("id") or f"call_{i}",
                        "type": "function",
                        "function": {
                            "name": call["name"],
                            "arguments": json.dumps(call["args"], ensure_ascii=False),
                        },
                    }
                    for i, call in enumerate(message.tool_calls)
                ]
            result.append(entry)
        elif isinstance(message, ToolMessage):
            entry = {
                "role": "tool",
                "content": message_text(message.content),
                "tool_call_id": message.tool_call_id,
            }
            if message.name:
                entry["name"] = message.name
            result.append(entry)
        elif isinstance(message, FunctionMessage):
            result.append(
                {"role": "tool", "content": message_text(message.content), "name": message.name}
            )
        elif isinstance(message, ChatMessage):
            result.append({"role": message.role, "content": message_text(message.content)})
        else:
            raise ValueError(
                f"cannot send a {type(message).__name__} to the model: use System, Human, AI, "
                "Tool or Chat messages"
            )
    return result
