"""From engine requests to what callers see: one `RequestOutput` per user request.

A user request with `n` samples is one `RequestGroup` of `n` engine `Request`s; its
output gathers their completions, as cumulative text, as deltas, or once at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .metrics import FinishedRequestStats
from .outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from .request import Request
from .sampling_params import RequestOutputKind, SamplingParams


@dataclass(eq=False, slots=True)
class RequestGroup:
    """One user request: its prompt and the `n` sampled sequences (children)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    arrival_time: float
    # What DELTA outputs already sent, per child: (characters, tokens).
    sent: list[tuple[int, int]] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(child.is_finished for child in self.children)


def make_request_output(group: RequestGroup) -> RequestOutput | EmbeddingRequestOutput | None:
    """The output to hand the caller now: cumulative, the delta since the last one, or
    nothing (FINAL_ONLY before the end). Updates what DELTA outputs have sent."""
    finished = group.finished
    if group.children[0].pooling is not None:
        return _embedding_output(group) if finished else None
    kind = group.params.output_kind
    if kind == RequestOutputKind.FINAL_ONLY and not finished:
        return None
    outputs = []
    for index, child in enumerate(group.children):
        assert child.detokenizer is not None
        text = child.detokenizer.streamable_text(child.is_finished)
        token_ids = child.output_token_ids
        logprobs = child.logprobs
        if kind == RequestOutputKind.DELTA:
            sent_chars, sent_tokens = group.sent[index]
            group.sent[index] = (len(text), len(token_ids))
            text, token_ids = text[sent_chars:], token_ids[sent_tokens:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        outputs.append(
            CompletionOutput(
                index=child.sample_index,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                logprobs=logprobs,
                finish_reason=child.status.finish_reason,
                stop_reason=child.stop_reason,
            )
        )
    first = group.children[0]
    metrics = RequestMetrics(
        arrival_time=group.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=first.first_token_time,
        last_token_time=first.last_token_time,
        finished_time=time.monotonic() if finished else None,
        num_cached_tokens=max(first.num_cached_tokens, 0),
        num_preemptions=sum(c.num_preemptions for c in group.children),
    )
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=outputs,
        finished=finished,
        metrics=metrics,
        num_cached_tokens=metrics.num_cached_tokens,
        error=group.error,
    )


def finished_request_stats(group: RequestGroup) -> list[FinishedRequestStats]:
    """Latency and token figures of a finished request's samples, for the stat loggers."""
    now = time.monotonic()
    return [
        FinishedRequestStats(
            finish_reason=child.status.finish_reason or "abort",
            e2e_latency=now - child.arrival_time,
            num_prompt_tokens=child.num_prompt_tokens,
            num_generation_tokens=child.num_output_tokens,
            queue_time=(child.first_scheduled_time or now) - child.arrival_time,
        )
        for child in group.children
    ]


def _embedding_output(group: RequestGroup) -> EmbeddingRequestOutput:
    request = group.children[0]
    assert request.pooling is not None
    vector = request.pooling.result
    return EmbeddingRequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=EmbeddingOutput(vector) if vector is not None else None,
        finished=True,
        metrics=RequestMetrics(
            arrival_time=group.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            finished_time=time.monotonic(),
        ),
        error=group.error,
        finish_reason=request.status.finish_reason,
    )
