"""The one way past the EngineClient boundary, for tests and benchmarks.

Front ends (LangChain, LlamaIndex, the server, the CLI) talk to an engine through
`EngineClient` only. Tests and benchmarks that inspect what the engine thread owns (its
compute plan, model, KV pool, executor, counters) reach it through `core_of`, so that a
reader sees at once where code looks inside, and the boundary's shape can change in one
place. Reading the core from another thread races with the engine thread: read what is
settled (the plan, the model, sizes) or what the engine is done with (after `generate`).
"""

from __future__ import annotations

from typing import Any

from .llm_engine import LLMEngine


def core_of(front: Any) -> LLMEngine:
    """The LLMEngine behind a front end that holds its engine client as `.engine` (the
    offline `LLM`, the LangChain and LlamaIndex wrappers), an `AsyncEngine`, or an
    LLMEngine itself. TypeError where there is none in this process (a Ray replica)."""
    what = type(front).__name__
    for _ in range(3):  # front end -> AsyncEngine -> LLMEngine
        if isinstance(front, LLMEngine):
            return front
        front = getattr(front, "engine", None)
    raise TypeError(f"no in-process engine core behind {what}")
