"""tool_choice planned (its one reader, `normalize_tool_choice`, is in tool_calls.py), and the one rule for tools against structured
output. Same input, same answer, whichever front end it came through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.sampling_params import StructuredOutputsParams
from .errors import ChatRequestError
from .tool_calls import NamedChoice, normalize_tool_choice, normalize_tools, tool_call_constraint


@dataclass(slots=True)
class ToolPlan:
    """What a chat call's tools and structured output amount to."""

    tools: list[dict] | None  # normalized tools described in the prompt (None: no tools)
    tool_choice: str | NamedChoice
    constraint: StructuredOutputsParams | None  # the grammar the answer is decoded under
    forced: str | None  # "tool call" | "structured output": what an answer cut off loses
    # The model's markup of calls (tool_formats.py; None: the Hermes default).
    tool_format: Any = None

    @property
    def call_open(self) -> str:
        """The text a call starts with in this model's markup ("" when calls have none)."""
        from .tool_formats import resolve_format

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
    `tool_format`'s markup (the model's: `model_tool_format(client)`).
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
