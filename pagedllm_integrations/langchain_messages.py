"""LangChain <-> OpenAI chat messages, tool_choice spellings, and the gate that holds back
streamed text that may turn out to be a tool call. Pure Python: no engine, no model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


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
                raise ValueError(
                    f"a {kind!r} content block was given, but pagedllm models read text only"
                )
            # tool_use / thinking / reasoning blocks: the tool calls travel in tool_calls.
    return "".join(parts)


def to_openai_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """LangChain messages -> OpenAI chat dicts, the form `render_chat_prompt` takes."""
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


def normalize_tool_choice(tool_choice: Any, tool_names: list[str]) -> str | dict | None:
    """LangChain's tool_choice spellings -> OpenAI's: auto, none, required, or a named tool."""
    if tool_choice is None:
        return None
    if tool_choice == "auto":
        return "auto"
    if tool_choice in ("any", "required"):
        return "required"
    if tool_choice is True:
        if len(tool_names) != 1:
            raise ValueError("tool_choice=True needs exactly one tool; name the tool instead")
        tool_choice = tool_names[0]
    if tool_choice is False or tool_choice == "none":
        return "none"
    name: Any
    if isinstance(tool_choice, str):
        name = tool_choice
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if not name:
            raise ValueError(f"tool_choice dict {tool_choice!r} names no function")
    else:
        raise ValueError(
            f"tool_choice must be 'auto', 'any', 'required', 'none', a tool name or a dict; "
            f"got {tool_choice!r}"
        )
    if name not in tool_names:
        raise ValueError(f"tool_choice names {name!r}, but the bound tools are {tool_names}")
    return {"type": "function", "function": {"name": name}}


class ToolCallGate:
    """Splits streamed text, with tools bound, into what is surely answer text (sent at once)
    and what may be a tool call (held until the end, when `parse_tool_calls` decides).

    Held: output that opens like a bare JSON call (`{`, `[`, a code fence), everything from
    the model's call tag on (`<tool_call>`, `<|tool_call|>`; Gemma's calls have none), and a
    tail that could be the start of that tag.
    """

    def __init__(self, call_open: str) -> None:
        self.call_open = call_open
        self.sent = ""
        self.pending = ""
        self.holding = False

    def feed(self, delta: str) -> str:
        """Add new text; return the part that can be shown now."""
        self.pending += delta
        if self.holding:
            return ""
        if not self.sent:
            head = self.pending.lstrip()
            if not head:
                return ""
            if head[0] in "{[`":
                self.holding = True
                return ""
        index = self.pending.find(self.call_open) if self.call_open else -1
        if index >= 0:
            ready, self.pending = self.pending[:index], self.pending[index:]
            self.holding = True
        else:
            keep = _partial_tag_length(self.pending, self.call_open) if self.call_open else 0
            cut = len(self.pending) - keep
            ready, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += ready
        return ready

    def finish(self) -> str:
        """The held text (to parse for calls) at the end of the output."""
        held, self.pending = self.pending, ""
        return held


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
