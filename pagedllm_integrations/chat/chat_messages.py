"""OpenAI-format chat messages as the chat templates and tool-call formats need them, and
the parsed tool call record. Shared by `tool_calls.py` (the public functions) and
`tool_formats.py` (each family's markup), so neither imports the other's internals.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine.request_limits import check_schema

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class ToolCall:
    id: str  # "call_<hex>"
    name: str
    arguments: dict  # the parsed JSON object

    def to_openai(self) -> dict:
        """As an OpenAI chat `tool_calls` entry (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(
                f"message {position} must be a dict with role system/user/assistant/tool, "
                f"got {message!r}"
            )


# Content a text-only model cannot read, by the content-part types of OpenAI, LangChain and
# LlamaIndex, and what to call it in an error.
_NOT_TEXT = {
    "image": "images are",
    "image_url": "images are",
    "input_image": "images are",
    "audio": "audio is",
    "input_audio": "audio is",
    "video": "video is",
    "file": "files are",
    "input_file": "files are",
    "document": "documents are",
}


def not_text_message(kind: str) -> str:
    """The error for a content part of type `kind` that is not text (an image, audio...)."""
    what = _NOT_TEXT.get(kind, f"{kind!r} content parts are")
    return f"{what} not supported by this model: it reads text only; send the content as text"


def content_text(content: Any) -> str:
    """Message content as text (a string, None, or a list of OpenAI content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict) and isinstance(part.get("type"), str):
                raise ValueError(not_text_message(part["type"]))
            else:
                raise ValueError(f"only text content parts are supported, got {part!r}")
        return "".join(parts)
    return str(content)


def arguments_dict(arguments: Any) -> dict:
    if isinstance(arguments, str):
        loaded = load_json(arguments) if arguments.strip() else {}
        if loaded is None:
            raise ValueError(f"tool call arguments are not valid JSON: {_clip(arguments)!r}")
        if isinstance(loaded, dict):
            check_schema(loaded, "tool call arguments")
            return loaded
    if isinstance(arguments, dict):
        check_schema(arguments, "tool call arguments")
        return arguments
    raise ValueError(f"tool call arguments must be a JSON object, got {_clip(repr(arguments))}")


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def load_json(text: str) -> Any:
    """json.loads, or None for text that is not JSON, including JSON nested deeper than
    the parser's recursion limit (model output like `[[[[...` under tools)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def call_entries(message: dict) -> list[tuple[str, dict]]:
    """(name, arguments) of an assistant message's tool calls."""
    entries = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"malformed tool call in an assistant message: {call!r}")
        entries.append((function["name"], arguments_dict(function.get("arguments", {}))))
    return entries


def messages_for_template(messages: list[dict]) -> list[dict]:
    """Messages as Hugging Face tool-aware templates expect them (arguments as dicts)."""
    converted = []
    for message in messages:
        out = {"role": message["role"], "content": content_text(message.get("content"))}
        if message["role"] == "developer":
            out["role"] = "system"
        if message.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": call.get("id") or new_call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for call, (name, arguments) in zip(message["tool_calls"], call_entries(message))
            ]
        for key in ("tool_call_id", "name"):
            if key in message:
                out[key] = message[key]
        converted.append(out)
    return converted


def arguments_schema(parameters: dict) -> dict:
    """The tool's parameter schema; an argument list is always a JSON object."""
    schema = copy.deepcopy(parameters) if parameters else copy.deepcopy(EMPTY_PARAMETERS)
    schema.setdefault("type", "object")
    if schema.get("type") == "object":
        schema.setdefault("properties", {})
    return schema


_FENCE_LANGUAGES = ("json", "tool_code", "python")


def strip_code_fence(text: str) -> str:
    """The body of a text that is one code fence (```json ... ```), else the text.

    String operations, not a regex: model output can hold long runs of white space, on
    which a backtracking pattern takes time quadratic in their length."""
    if len(text) < 6 or not (text.startswith("```") and text.endswith("```")):
        return text
    body = text[3:-3]
    for language in _FENCE_LANGUAGES:
        if body.startswith(language):
            body = body[len(language) :]
            break
    return body.strip()


def call_from_json(body: str, known: set[str] | None) -> list[ToolCall] | None:
    """The calls in a JSON text (one call object or a list of them); None if it is not that."""
    loaded = load_json(body.strip())
    if loaded is None:
        return None
    items = loaded if isinstance(loaded, list) else [loaded]
    calls = [call_from_object(item, known) for item in items]
    if not items or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def call_from_object(item: Any, known: set[str] | None) -> ToolCall | None:
    """A call from {"name", "arguments"} (or Gemma's "parameters", or an OpenAI entry)."""
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):  # an OpenAI-style entry
        item = item["function"]
    name = item.get("name")
    if not isinstance(name, str) or not name or (known is not None and name not in known):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = load_json(arguments) if arguments.strip() else {}
        if arguments is None:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    try:  # arguments nested past the limits would recurse when serialized again
        check_schema(arguments, "tool call arguments")
    except ValueError:
        return None
    return ToolCall(new_call_id(), name, arguments)


def parse_tagged_blocks(
    text: str, block: re.Pattern, known: set[str] | None
) -> tuple[str, list[ToolCall]]:
    """Calls in tagged blocks (a last block may lack its closing tag); a block that does not
    hold valid calls stays in the content."""
    kept: list[str] = []
    calls: list[ToolCall] = []
    position = 0
    for match in block.finditer(text):
        found = call_from_json(match.group(1), known)
        kept.append(text[position : match.start()])
        if found is None:
            kept.append(match.group(0))
        else:
            calls.extend(found)
        position = match.end()
    kept.append(text[position:])
    return ("".join(kept).strip() if calls else text), calls


def parse_bare_json(text: str, known: set[str] | None) -> tuple[str, list[ToolCall]]:
    """A whole output that is one JSON call object, or a list of them."""
    stripped = strip_code_fence(text.strip())
    if stripped[:1] in ("{", "["):
        found = call_from_json(stripped, known)
        if found:
            return "", found
    return text, []
