"""The engine's record of one sequence being generated.

A request with `n > 1` is fanned out into `n` `Request`s (one per sample) that share the
prompt; the prefix cache makes them share the prompt's KV blocks too.

Token accounting (vLLM v1's model: no prefill or decode phase, only two counters):

    all_token_ids:  | prompt ............................ | outputs ...... |
                    |<-- num_computed_tokens -->|                          |
                    |<------------------------- num_tokens -------------->|

Each step schedules some of the `num_tokens - num_computed_tokens` tokens whose KV is not
yet in the cache. When the last one is computed, the logits of that position give the next
token, which is appended (so num_tokens grows by one and the gap is one again).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from .detokenizer import IncrementalDetokenizer
    from .pooling import PoolingState

# What the sampler reports per sampled token when logprobs are asked for:
# (the token's logprob, its rank, the top-k ids, the top-k logprobs).
LogprobInfo = tuple[float, int, list[int], list[float]]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


_arrival_counter = itertools.count()


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Ties in arrival_time are broken by submission order.
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    # Who sent it (the server sets it per client; engine/client_share.py): requests of
    # different clients share each step fairly. None: the in-process engine's one client.
    client_id: str | None = None
    # Set by the engine:
    parent_id: str | None = None
    sample_index: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hits when first scheduled; -1 before that
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0
    detokenizer: IncrementalDetokenizer | None = None
    structured: Any = None  # a grammar matcher when the request is constrained
    draft_index: Any = None  # speculative decoding: the n-gram index of its tokens
    # An embedding request (engine/pooling.py): its pooled rows so far; no tokens are sampled.
    pooling: PoolingState | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def record_logprobs(self, token_id: int, info: LogprobInfo) -> None:
        """Keep the logprobs of the token just appended: {token id: Logprob} for it and the
        top-k, each with its text."""
        from .outputs import Logprob

        assert self.logprobs is not None
        chosen, rank, top_ids, top_values = info
        text = self.detokenizer.token_text if self.detokenizer is not None else _no_text
        entry = {token_id: Logprob(chosen, rank, text(token_id))}
        for top_rank, (top_id, value) in enumerate(zip(top_ids, top_values), start=1):
            entry.setdefault(top_id, Logprob(value, top_rank, text(top_id)))
        self.logprobs.append(entry)
        self.cumulative_logprob += chosen

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}"
            f"/{self.num_tokens}, out={self.num_output_tokens})"
        )


def _no_text(token_id: int) -> None:
    return None
