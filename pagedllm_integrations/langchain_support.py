"""What PagedLLM and ChatPagedLLM share beyond the engine they hold (owner.py): the
provider name LangChain traces, and the call-time arguments LangChain passes."""

from __future__ import annotations

from typing import Any

from .chat.sampling import SAMPLING_FIELDS

PROVIDER = "pagedllm"  # ls_provider and response_metadata["model_provider"]

# Call-time keyword arguments LangChain itself may send that carry no sampling meaning here.
IGNORED_CALL_KWARGS = frozenset({"model", "stream", "parallel_tool_calls", "strict"})


def split_call_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Sampling parameters given at call time; anything else is a ValueError naming it."""
    unknown = sorted(set(kwargs) - SAMPLING_FIELDS - IGNORED_CALL_KWARGS)
    if unknown:
        raise ValueError(
            f"unknown call argument(s) {unknown}: pass sampling parameters "
            f"({sorted(SAMPLING_FIELDS)}) or bind tools with bind_tools()"
        )
    return {k: v for k, v in kwargs.items() if k in SAMPLING_FIELDS}
