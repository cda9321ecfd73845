"""What a finished choice means: its tool calls and content, its finish reason, whether a
forced tool call or structured output was cut off, and token usage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.outputs import RequestOutput
from .errors import IncompleteOutputError
from .tool_calls import ToolCall, parse_tool_calls
from .tool_choice import ToolPlan


@dataclass(slots=True)
class ChatChoice:
    content: str  # the text besides the tool calls
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # "tool_calls" when calls were read, else the engine's


def read_choice(text: str, finish_reason: str | None, plan: ToolPlan | None) -> ChatChoice:
    """Tool calls are read out of the text when tools were offered."""
    if plan is None or not plan.tools:
        return ChatChoice(text, [], finish_reason)
    content, calls = parse_tool_calls(text, plan.tools, plan.tool_format)
    return ChatChoice(content, calls, "tool_calls" if calls else finish_reason)


def check_complete(
    plan: ToolPlan | None,
    choice: ChatChoice,
    raw_finish_reason: str | None,
    num_tokens: int,
    max_tokens: int | None,
) -> None:
    """IncompleteOutputError when the forced tool call or structured output of `plan` ended
    on the token limit before it was whole: no complete call was read, or the document was
    cut. Passing that on as an answer (no call, half a document) would hide it. (Parallel
    calls cut after a complete one keep the calls that were read.)"""
    if plan is None or plan.forced is None or raw_finish_reason != "length":
        return
    if plan.forced == "tool call" and choice.tool_calls:
        return
    limit = f"max_tokens={max_tokens}" if max_tokens is not None else "the context length"
    raise IncompleteOutputError(
        f"the forced {plan.forced} was cut off after {num_tokens} tokens by {limit} before it "
        "was complete; raise max_tokens (or leave it unset), shorten the prompt, or bound "
        "the schema's strings"
    )


@dataclass(slots=True)
class Usage:
    """Token counts of one request (or several, added up)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(cls, outputs: Sequence[RequestOutput], completion_tokens: int | None = None) -> Usage:
        """From final outputs; `completion_tokens` when a DELTA stream counted them."""
        counted = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return cls(
            prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
            completion_tokens=counted if completion_tokens is None else completion_tokens,
            cached_tokens=sum(o.num_cached_tokens for o in outputs),
        )

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cached_tokens + other.cached_tokens,
        )

    def to_openai(self, report_cached: bool = True) -> dict[str, Any]:
        """OpenAI's `usage` object. report_cached=False leaves out the prefix-cache hits
        (`prompt_tokens_details`): on a server shared by tenants they tell one client
        whether another sent the same prompt prefix."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage
