"""tool_choice in every front end's spelling, and the one rule for tools against structured
output. Same input, same answer, whichever front end it came through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.sampling_params import StructuredOutputsParams
from ..engine.tool_calls import normalize_tools, tool_call_constraint
from .errors import ChatRequestError

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
            f"tool_choice names tool {name!r}, but the tools given are {names}", "tool_choice"
        )
    return {"type": "function", "function": {"name": name}}


@dataclass(slots=True)
class ToolPlan:
    """What a chat call's tools and structured output amount to."""

    tools: list[dict] | None  # normalized tools described in the prompt (None: no tools)
    tool_choice: str | NamedChoice
    constraint: StructuredOutputsParams | None  # the grammar the answer is decoded under
    forced: str | None  # "tool call" | "structured output": what an answer cut off loses
    # The model's markup of calls (engine/tool_formats.py; None: the Hermes default).
    tool_format: Any = None

    @property
    def call_open(self) -> str:
        """The text a call starts with in this model's markup ("" when calls have none)."""
        from ..engine.tool_formats import resolve_format

        return resolve_format(self.tool_format).call_open


def plan_tools(
    tools: list | None,
    tool_choice: Any = None,
    structured: StructuredOutputsParams | None = None,
    parallel_tool_calls: bool = False,
    tool_format: Any = None,
) -> ToolPlan:
    """The rule for tools against a structured output, for every front end.

    tool_choice "none" takes the tools out of the prompt. Tools on offer ("auto", "required"
    or a named tool) together with a structured output is a ValueError: the answer is
    decoded under one constraint, and it cannot be both a free choice of calling a tool and
    a document of a given shape (a silent preference would ignore one of the two settings).
    "required" or a named tool forces a schema-valid call by constrained decoding, in
    `tool_format`'s markup (the model's: `EngineClient.tool_format`).
    """
    try:
        normalized = normalize_tools(list(tools)) if tools else []
    except ValueError as error:
        raise ChatRequestError(str(error), "tools") from error
    choice = normalize_tool_choice(tool_choice, normalized)
    offered = normalized if normalized and choice != "none" else None
    if offered and structured is not None:
        raise ChatRequestError(
            f"tools (tool_choice {_describe(choice)}) and a structured output cannot both shape "
            "one answer: drop the tools (or set tool_choice='none'), or drop the structured "
            "output (response_format / with_structured_output / json mode)",
            "response_format",
        )
    if offered:
        try:
            forced_call = tool_call_constraint(
                offered, choice, parallel_tool_calls=parallel_tool_calls, tool_format=tool_format
            )
        except ValueError as error:  # a tool schema the grammar compiler refuses
            raise ChatRequestError(str(error), "tools") from error
        forced = "tool call" if forced_call else None
        return ToolPlan(offered, choice, forced_call, forced, tool_format)
    forced = "structured output" if structured else None
    return ToolPlan(None, choice, structured, forced, tool_format)


def _describe(choice: str | NamedChoice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice["function"]["name"])
