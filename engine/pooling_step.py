"""The engine step's part for embedding requests: what the model ran adds to each request's
pooled vector, and a request whose last prompt row ran ends there, its KV blocks freed.

    schedule -> execute (hidden states; pooled parts: engine/pooling.py's pool_step)
      -> sample (generation requests only) -> update -> finish_pooled
"""

from __future__ import annotations

from typing import Any

from .metrics import IterationStats
from .pooling import PooledParts
from .request import Request, RequestStatus

RUNNERS = ("auto", "generate", "pooling")


def model_tasks(runner: str, encoder: bool, tensor_parallel_size: int) -> tuple[str, ...]:
    """What an engine serves: ("generate", "embed"), ("generate",) or ("embed",).

    runner="auto": an encoder embeds; a decoder generates, and embeds too (last-token
    pooling by default) where its whole model is in this process.
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if encoder:
        if runner == "generate":
            raise ValueError(
                "runner='generate' asks for text generation, but this model is an encoder "
                "(an embedding model): use runner='pooling' or 'auto'"
            )
        return ("embed",)
    if runner == "pooling" and tensor_parallel_size > 1:
        raise ValueError("runner='pooling' needs tensor_parallel_size=1")
    if runner == "pooling":
        return ("embed",)
    if runner == "generate" or tensor_parallel_size > 1:
        return ("generate",)
    return ("generate", "embed")


def finish_pooled(
    step: Any, pooled: PooledParts, scheduler: Any, iteration: IterationStats
) -> list[Request]:
    """Add each embedding request's part of this step (`step`: the SchedulerOutput just
    run) and finish those whose prompt is now all computed: their vector is made and their
    blocks freed. Returns the requests that finished."""
    finished = []
    for index, item in enumerate(step.scheduled):
        request = item.request
        state = request.pooling
        if state is None or request.is_finished:  # a generation request, or aborted
            continue
        part = pooled.get(index)
        if part is not None:
            state.add(*part)
        if item.completes_prompt:
            state.finish(request.num_prompt_tokens)
            scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
            iteration.num_prompt_tokens += request.num_prompt_tokens
            finished.append(request)
    return finished
