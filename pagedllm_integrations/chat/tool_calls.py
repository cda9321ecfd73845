"""Tool (function) calling: tool specs, chat prompts with tools, forced calls, call parsing.

The markup of calls is the model's own (`tool_formats.py`: Hermes/Qwen `<tool_call>` JSON,
Phi-4-mini's `<|tool_call|>[...]`, Gemma's JSON calls), read from the model's chat template
(`model_tool_format(client)`) and passed to these functions. Without one they
use the Hermes / Qwen markup, which many open models were trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`render_chat_prompt` uses the tokenizer's own chat template where it takes `tools`; otherwise
(SmolLM2's template does not) the format writes a system-prompt section that lists the tools
and asks for its markup, and renders earlier calls and tool results as text.
`tool_call_constraint` turns tool_choice "required" / a named tool into a grammar that forces
schema-valid calls in that markup, and `parse_tool_calls` reads calls back out of generated text.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from ..engine.request_limits import MAX_TOOLS, SchemaBudget, check_text
from ..engine.sampling_params import StructuredOutputsParams
from .chat_messages import (
    EMPTY_PARAMETERS,
    ToolCall,
    call_entries,
    check_messages,
    new_call_id,
)
from .errors import ChatRequestError
from .tool_formats import FORMATS, HERMES, ToolCallFormat, resolve_format, tool_format_for

logger = logging.getLogger(__name__)

CALL_OPEN = HERMES.call_open
CALL_CLOSE = HERMES.close
ToolFormatArg = ToolCallFormat | str | None

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "FORMATS",
    "ToolCall",
    "ToolCallFormat",
    "call_entries",
    "format_call",
    "new_call_id",
    "normalize_tool_choice",
    "normalize_tools",
    "parse_tool_calls",
    "render_chat_prompt",
    "tool_call_constraint",
    "tool_format_for",
    "tools_system_section",
]


# ------------------------------------------------------------------------------ tools
def normalize_tools(tools: list) -> list[dict]:
    """Tools as OpenAI-style dicts {"type": "function", "function": {name, description,
    parameters}}. Accepts that form, a bare {name, description, parameters}, and the flat
    {"type": "function", "name": ...} form. ValueError on a malformed tool."""
    if tools is None:
        return []
    if not isinstance(tools, list | tuple):
        raise ValueError(f"tools must be a list of tool specs, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{len(tools)} tools were given; the limit is {MAX_TOOLS} tools")
    normalized = []
    seen: set[str] = set()
    # Checked before they are copied, rendered or compiled: every one of those recurses on
    # the schema's depth (engine/request_limits.py).
    budget = SchemaBudget()
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
            parameters = copy.deepcopy(EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValueError(f"tool {name!r}: 'parameters' must be a JSON schema dict")
        check_text(name, "a tool name")
        check_text(description, f"the description of tool {name!r}")
        budget.check(parameters, f"the parameters schema of tool {name!r}")
        function: dict[str, Any] = {
            "name": name,
            "description": description,
            "parameters": copy.deepcopy(parameters),
        }
        if "strict" in spec:
            function["strict"] = bool(spec["strict"])
        normalized.append({"type": "function", "function": function})
    return normalized


# ------------------------------------------------------------------- tool_choice
NamedChoice = dict[str, Any]  # {"type": "function", "function": {"name": ...}}


def normalize_tool_choice(tool_choice: Any, tools: list[dict] | None) -> str | NamedChoice:
    """ "auto", "none", "required" or {"type": "function", "function": {"name": ...}}.

    Accepts OpenAI's values, LangChain's ("any", True for the only tool, False, a tool
    name, {"name": ...}) and None (auto when tools are given, else none). ValueError for
    anything else, for a name that is not among `tools` (normalized tool dicts), and for
    a forced call without tools.
    """
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice is False or tool_choice == "none":
        return "none"
    if tool_choice == "auto":
        return "auto"
    if tool_choice in ("any", "required"):
        if not names:
            raise ChatRequestError(
                f"tool_choice {tool_choice!r} forces a tool call but no tools were given",
                "tool_choice",
            )
        return "required"
    if tool_choice is True:
        if len(names) != 1:
            raise ChatRequestError(
                f"tool_choice=True needs exactly one tool, got {len(names)}; name the tool instead",
                "tool_choice",
            )
        tool_choice = names[0]
    name: Any
    if isinstance(tool_choice, str):
        name = tool_choice
    elif isinstance(tool_choice, dict):
        if tool_choice.get("type", "function") != "function":
            raise ChatRequestError(
                f"tool_choice type must be 'function', got {tool_choice!r}", "tool_choice"
            )
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise ChatRequestError(f"tool_choice {tool_choice!r} names no function", "tool_choice")
    else:
        raise ChatRequestError(
            "tool_choice must be 'auto', 'none', 'required'/'any', a tool name or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}; got {tool_choice!r}",
            "tool_choice",
        )
    if name not in names:
        raise ChatRequestError(
            f"tool_choice names tool {name!r}, but the tools given are {names} "
            f"({name!r} is not among them)",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def _read_choice(tool_choice: Any, tools: list[dict]) -> tuple[str, str | None]:
    """(mode, forced tool): mode 'auto', 'none', 'required' or 'named', as the one reader
    (`normalize_tool_choice`) reads `tool_choice` against the normalized `tools`."""
    choice = normalize_tool_choice(tool_choice, tools)
    if isinstance(choice, dict):
        return "named", choice["function"]["name"]
    return choice, None


# ---------------------------------------------------------------------- constraint
def tool_call_constraint(
    tools: list[dict] | None,
    tool_choice: Any,
    *,
    parallel_tool_calls: bool = False,
    max_calls: int = 4,
    tool_format: ToolFormatArg = None,
) -> StructuredOutputsParams | None:
    """A grammar that forces tool calls (in `tool_format`'s markup; default Hermes), or None
    when the output stays free text.

    `tool_choice` in any spelling `normalize_tool_choice` reads. None for "auto" / "none".
    "required": one call of any defined tool (with parallel_tool_calls: 1..max_calls calls,
    newline-separated; the bound keeps a small model from repeating calls until max_tokens)
    whose arguments are valid against that tool's schema. A named tool: a call of that
    tool. ValueError for an unknown tool name or no tools.
    """
    normalized = normalize_tools(tools or [])
    mode, forced = _read_choice(tool_choice, normalized)
    if mode in ("auto", "none"):
        return None
    if forced is not None:
        normalized = [t for t in normalized if t["function"]["name"] == forced]
    grammar = resolve_format(tool_format).constraint_grammar(
        normalized, parallel_tool_calls, max_calls
    )
    return StructuredOutputsParams(grammar=grammar)


# -------------------------------------------------------------------------- parsing
def parse_tool_calls(
    text: str, tools: list[dict] | None = None, tool_format: ToolFormatArg = None
) -> tuple[str, list[ToolCall]]:
    """(remaining content, calls) read from generated text.

    With a format, calls in its markup; without one, in any known markup (they do not
    overlap: tagged blocks first, then a bare JSON call object or list as the whole output).
    A block with invalid JSON or naming an unknown tool (when `tools` is given) stays in the
    content.
    """
    known = None
    if tools:
        known = {t["function"]["name"] for t in normalize_tools(tools)}
    if tool_format is not None:
        return resolve_format(tool_format).parse(text, known)
    for fmt in FORMATS.values():
        content, calls = fmt.parse(text, known)
        if calls:
            return content, calls
    return text, []


# -------------------------------------------------------------------------- prompts
def render_chat_prompt(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tool_format: ToolFormatArg = None,
) -> str:
    """The prompt text for OpenAI-format chat messages, with the tools described in it (in
    `tool_format`'s way; None: the one the tokenizer's chat template implies).

    template_kwargs: more variables for the chat template (e.g. enable_thinking).
    """
    normalized = normalize_tools(tools or [])
    mode, forced = _read_choice(tool_choice, normalized)
    if mode == "none":
        normalized = []
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; cannot render chat messages")
    check_messages(messages)
    fmt = resolve_format(tool_format) if tool_format is not None else tool_format_for(tokenizer)
    return fmt.render(
        tokenizer,
        messages,
        normalized,
        tool_choice,
        mode,
        forced,
        add_generation_prompt,
        dict(template_kwargs or {}),
    )


def format_call(name: str, arguments: dict, tool_format: ToolFormatArg = None) -> str:
    """One call in the markup the model is asked to write (and the grammar forces)."""
    return resolve_format(tool_format).format_calls([(name, arguments)])


def tools_system_section(
    tools: list[dict], tool_choice: Any, tool_format: ToolFormatArg = None
) -> str:
    """The system-prompt section that lists the tools, for a template that does not."""
    normalized = normalize_tools(tools)
    mode, forced = _read_choice(tool_choice, normalized)
    return resolve_format(tool_format).tools_section(normalized, mode, forced)
