"""Tool (function) calling: tool specs, chat prompts with tools, forced calls, call parsing.

The markup of calls is the model's own (`tool_formats.py`: Hermes/Qwen `<tool_call>` JSON,
Phi-4-mini's `<|tool_call|>[...]`, Gemma's JSON calls); the engine picks it once from the
model (`LLMEngine.tool_format`) and front ends pass it to these functions. Without one they
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

from .chat_messages import (
    EMPTY_PARAMETERS,
    ToolCall,
    call_entries,
    check_messages,
    new_call_id,
)
from .request_limits import MAX_TOOLS, SchemaBudget, check_text
from .sampling_params import StructuredOutputsParams
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
    tool_format: ToolFormatArg = None,
) -> StructuredOutputsParams | None:
    """A grammar that forces tool calls (in `tool_format`'s markup; default Hermes), or None
    when the output stays free text.

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
    mode = _choice_mode(tool_choice)
    normalized = normalize_tools(tools or []) if mode != "none" else []
    forced = _tool_choice_name(tool_choice) if mode == "named" else None
    if forced is not None and forced not in {t["function"]["name"] for t in normalized}:
        raise ValueError(f"tool_choice names tool {forced!r}, which is not among the tools")
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
    tools: list[dict], tool_choice: Any, mode: str, tool_format: ToolFormatArg = None
) -> str:
    """The system-prompt section that lists the tools, for a template that does not."""
    forced = _tool_choice_name(tool_choice) if mode == "named" else None
    return resolve_format(tool_format).tools_section(tools, mode, forced)
