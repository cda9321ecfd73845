"""What `ChatPagedLLM.bind_tools` returns: LangChain's binding of the tools, which refuses
`with_structured_output`.

LangChain hands a binding's `with_structured_output` to the model it wraps, without the
bound tools, so `bind_tools(tools).with_structured_output(schema)` would run with the
tools silently dropped. A call is decoded under one constraint, a tool call or a
structured output, so the combination is refused with the same rule as `tools` with a
`response_format` everywhere else.
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableBinding

TOOLS_AND_STRUCTURE = (
    "bind_tools(...).with_structured_output(...) would drop the bound tools (LangChain "
    "passes with_structured_output to the model without them), and an answer is decoded "
    "under one constraint, a tool call or a structured output: call "
    "with_structured_output on the chat model itself (method='function_calling' answers "
    "with a call of a tool made from the schema), or keep the tools and parse their calls"
)


class ToolsBinding(RunnableBinding):
    """A chat model with tools bound; `.bind(...)` keeps this class (RunnableBinding.bind
    builds `self.__class__`)."""

    def with_structured_output(self, *args: Any, **kwargs: Any) -> Any:
        if self.kwargs.get("tools"):
            raise ValueError(TOOLS_AND_STRUCTURE)
        return self.bound.with_structured_output(*args, **kwargs)  # type: ignore[attr-defined]
