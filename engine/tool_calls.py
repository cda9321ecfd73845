"""Tool (function) calling: tool specs, chat prompts with tools, forced calls, call parsing.

The markup of a call is the Hermes / Qwen one, which many open models were trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`render_chat_prompt` uses the tokenizer's own chat template when it takes `tools`; otherwise
(SmolLM2's template does not) it writes a system-prompt section that lists the tools and asks
for that markup, and renders earlier calls and tool results as text. `tool_call_constraint`
turns tool_choice "required" / a named tool into a grammar that forces schema-valid calls in
that markup, and `parse_tool_calls` reads calls back out of generated text.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


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


# ------------------------------------------------------------------------------ tools
def normalize_tools(tools: list) -> list[dict]:
    """Tools as OpenAI-style dicts {"type": "function", "function": {name, description,
    parameters}}. Accepts that form, a bare {name, description, parameters}, and the flat
    {"type": "function", "name": ...} form. ValueError on a malformed tool."""
    if tools is None:
        return []
    if not isinstance(tools, list | tuple):
        raise ValueError(f"tools must be a list of tool specs, got {type(tools).__name__}")
    normalized = []
    seen: set[str] = set()
    for position, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(
                f"tool {position} must be a dict like {{'type': 'function', 'function': "
                f"{{'name': ..., 'parameters': {{...}}}}}}, got {type(tool).__name__}"
            )
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise ValueError(
                    f"tool {position}: only type 'function' is supported, got {tool['type']!r}"
                )
            spec = tool["function"]
        else:
            spec = tool
        if not isinstance(spec, dict):
            raise ValueError(f"tool {position}: 'function' must be a dict")
        name = spec.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"tool {position} needs a non-empty string 'name'")
        if name in seen:
            raise ValueError(f"tool name {name!r} is defined twice")
        seen.add(name)
        description = spec.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"tool {name!r}: 'description' must be a string")
        parameters = spec.get("parameters")
        if parameters is None:
            parameters = copy.deepcopy(_EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValueError(f"tool {name!r}: 'parameters' must be a JSON schema dict")
        function: dict[str, Any] = {
            "name": name,
            "description": description,
            "parameters": copy.deepcopy(parameters),
        }
        if "strict" in spec:
            function["strict"] = bool(spec["strict"])
        normalized.append({"type": "function", "function": function})
    return normalized


def _tool_choice_name(tool_choice: Any) -> str | None:
    """The forced tool's name for a named tool_choice, else None."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(
                "a dict tool_choice must look like {'type': 'function', 'function': "
                f"{{'name': ...}}}}, got {tool_choice!r}"
            )
        return name
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required", "any"):
        return tool_choice
    return None


def _choice_mode(tool_choice: Any) -> str:
    """'auto', 'none', 'required' or 'named'."""
    if tool_choice is None or tool_choice is False or tool_choice == "auto":
        return "auto"
    if tool_choice == "none":
        return "none"
    if tool_choice is True or tool_choice in ("required", "any"):
        return "required"
    if _tool_choice_name(tool_choice) is not None:
        return "named"
    raise ValueError(
        f"tool_choice must be 'auto', 'none', 'required'/'any', a tool name or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
    )


# ---------------------------------------------------------------------- constraint
def tool_call_constraint(
    tools: list[dict] | None,
    tool_choice: Any,
    *,
    parallel_tool_calls: bool = False,
    max_calls: int = 4,
) -> StructuredOutputsParams | None:
    """A grammar that forces tool calls, or None when the output stays free text.

    None for tool_choice "auto" / "none" / None. "required" / "any" / True: one call of any
    defined tool (with parallel_tool_calls: 1..max_calls calls, newline-separated; the bound
    keeps a small model from repeating calls until max_tokens) whose arguments are
    valid against that tool's schema. A tool name or {"type": "function", "function":
    {"name": ...}}: a call of that tool. ValueError for an unknown tool name or no tools.
    """
    mode = _choice_mode(tool_choice)
    if mode in ("auto", "none"):
        return None
    normalized = normalize_tools(tools or [])
    if not normalized:
        raise ValueError(f"tool_choice {tool_choice!r} needs at least one tool")
    if mode == "named":
        name = _tool_choice_name(tool_choice)
        chosen = [t for t in normalized if t["function"]["name"] == name]
        if not chosen:
            known = [t["function"]["name"] for t in normalized]
            raise ValueError(f"tool_choice names tool {name!r}, which is not among {known}")
        normalized = chosen
    from .structured_outputs import tagged_json_grammar

    alternatives = [
        (
            f'{CALL_OPEN}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
            _arguments_schema(t["function"]["parameters"]),
            f"}}\n{CALL_CLOSE}",
        )
        for t in normalized
    ]
    if parallel_tool_calls and max_calls > 1:
        grammar = tagged_json_grammar(alternatives, "\n", max_calls)
    else:
        grammar = tagged_json_grammar(alternatives)
    return StructuredOutputsParams(grammar=grammar)


def _arguments_schema(parameters: dict) -> dict:
    """The tool's parameter schema; an argument list is always a JSON object."""
    schema = copy.deepcopy(parameters) if parameters else copy.deepcopy(_EMPTY_PARAMETERS)
    schema.setdefault("type", "object")
    if schema.get("type") == "object":
        schema.setdefault("properties", {})
    return schema


# -------------------------------------------------------------------------- parsing
def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """(remaining content, calls) read from generated text.

    Reads <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (a last block with
    no closing tag too), or a bare JSON call object (or a list of them) as the whole output.
    A block with invalid JSON or naming an unknown tool (when `tools` is given) stays in the
    content.
    """
    known = None
    if tools:
        known = {t["function"]["name"] for t in normalize_tools(tools)}
    calls: list[ToolCall] = []
    if CALL_OPEN in text:
        kept: list[str] = []
        position = 0
        for match in _CALL_RE.finditer(text):
            call = _call_from_json(match.group(1), known)
            kept.append(text[position : match.start()])
            if call is None:
                kept.append(match.group(0))
            else:
                calls.append(call)
            position = match.end()
        kept.append(text[position:])
        return "".join(kept).strip() if calls else text, calls
    stripped = _strip_code_fence(text.strip())
    if stripped[:1] in ("{", "["):
        try:
            loaded = json.loads(stripped)
        except json.JSONDecodeError:
            return text, []
        items = loaded if isinstance(loaded, list) else [loaded]
        parsed = [_call_from_object(item, known) for item in items]
        if items and all(call is not None for call in parsed):
            return "", [call for call in parsed if call is not None]
    return text, []


def _strip_code_fence(text: str) -> str:
    match = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
    return match.group(1) if match else text


def _call_from_json(body: str, known: set[str] | None) -> ToolCall | None:
    try:
        loaded = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    return _call_from_object(loaded, known)


def _call_from_object(item: Any, known: set[str] | None) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):  # an OpenAI-style entry
        item = item["function"]
    name = item.get("name")
    if not isinstance(name, str) or not name or (known is not None and name not in known):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name, arguments)


# -------------------------------------------------------------------------- prompts
def render_chat_prompt(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text for OpenAI-format chat messages, with the tools described in it.

    template_kwargs: more variables for the chat template (e.g. enable_thinking).
    """
    mode = _choice_mode(tool_choice)
    normalized = normalize_tools(tools or []) if mode != "none" else []
    if mode == "named":
        name = _tool_choice_name(tool_choice)
        if name not in {t["function"]["name"] for t in normalized}:
            raise ValueError(f"tool_choice names tool {name!r}, which is not among the tools")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; cannot render chat messages")
    _check_messages(messages)
    extra = dict(template_kwargs or {})
    if normalized and _template_takes_tools(tokenizer):
        return tokenizer.apply_chat_template(
            _messages_for_template(messages),
            tools=normalized,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    rendered = _messages_as_text(messages, normalized, tool_choice, mode)
    return tokenizer.apply_chat_template(
        rendered, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


def _template_takes_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the "tool_use" one, else the default
        template = template.get("tool_use") or template.get("default") or ""
    return isinstance(template, str) and "tools" in template


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise ValueError(
                f"message {position} must be a dict with role system/user/assistant/tool, "
                f"got {message!r}"
            )


def _content_text(content: Any) -> str:
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
            else:
                raise ValueError(f"only text content parts are supported, got {part!r}")
        return "".join(parts)
    return str(content)


def _arguments_dict(arguments: Any) -> dict:
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            loaded = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise ValueError(f"tool call arguments are not valid JSON: {arguments!r}") from error
        if isinstance(loaded, dict):
            return loaded
    raise ValueError(f"tool call arguments must be a JSON object, got {arguments!r}")


def _call_entries(message: dict) -> list[tuple[str, dict]]:
    """(name, arguments) of an assistant message's tool calls."""
    entries = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"malformed tool call in an assistant message: {call!r}")
        entries.append((function["name"], _arguments_dict(function.get("arguments", {}))))
    return entries


def _messages_for_template(messages: list[dict]) -> list[dict]:
    """Messages as Hugging Face tool-aware templates expect them (arguments as dicts)."""
    converted = []
    for message in messages:
        out = {"role": message["role"], "content": _content_text(message.get("content"))}
        if message["role"] == "developer":
            out["role"] = "system"
        if message.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": call.get("id") or new_call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for call, (name, arguments) in zip(message["tool_calls"], _call_entries(message))
            ]
        for key in ("tool_call_id", "name"):
            if key in message:
                out[key] = message[key]
        converted.append(out)
    return converted


def format_call(name: str, arguments: dict) -> str:
    """One call in the markup the model is asked to write (and the grammar forces)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def tools_system_section(tools: list[dict], tool_choice: Any, mode: str) -> str:
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to help with the user's request. The functions "
        "available, with the JSON schema of their arguments:",
        "",
        "<tools>",
    ]
    lines += [json.dumps(t["function"]) for t in tools]
    lines += [
        "</tools>",
        "",
        "To call a function, reply with a JSON object of its name and arguments inside "
        "<tool_call></tool_call> tags, one block per call:",
        format_call("function_name", {"argument_name": "value"}),
        "Results come back inside <tool_response></tool_response> tags.",
    ]
    if mode == "required":
        lines.append("You must call at least one of the functions now.")
    elif mode == "named":
        lines.append(f"You must call the function {_tool_choice_name(tool_choice)} now.")
    return "\n".join(lines)


def _messages_as_text(
    messages: list[dict], tools: list[dict], tool_choice: Any, mode: str
) -> list[dict]:
    """Plain {role, content} messages for a template without tool support."""
    out: list[dict] = []
    for message in messages:
        role = message["role"]
        content = _content_text(message.get("content"))
        if role == "developer":
            role = "system"
        if role == "assistant" and message.get("tool_calls"):
            calls = [format_call(name, arguments) for name, arguments in _call_entries(message)]
            content = "\n".join(([content] if content else []) + calls)
        if role == "tool":
            # Results go back as a user turn (the template knows no "tool" role); consecutive
            # results share one turn, as one reply to the calls before them.
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        out.append({"role": role, "content": content})
    if tools:
        section = tools_system_section(tools, tool_choice, mode)
        if out[0]["role"] == "system":
            out[0]["content"] = (
                f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
            )
        else:
            out.insert(0, {"role": "system", "content": section})
    return [{"role": m["role"], "content": m["content"]} for m in out]
