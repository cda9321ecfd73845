"""What the engine returns for a request, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated token: {token_id: Logprob} for the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic) and cache figures of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its `n` completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding: `data` float32 [dimensions] (normalized where the model or
    the request says), `embedding` the same as a list (vLLM's EmbeddingOutput)."""

    data: Any  # torch.Tensor

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return int(self.data.shape[0])


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """The result of an embedding request, shaped like vLLM's: `outputs.embedding`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None  # None when it failed or was aborted
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None
    finish_reason: str | None = None  # "stop" (embedded), "abort" or "error"
