"""A step's sampled tokens into its requests: the one place where a token is committed.

For each request of the step, in the step's order, the scheduler first counts what the
step computed (`Scheduler.advance`: rejected draft tokens give their slots back), then each
new token in turn goes through

    append -> statistics -> logprobs -> grammar -> detokenize (stop strings)
           -> stop rules (EOS, stop ids, max_tokens, max_model_len) -> finish

and no token after one that finished its request is committed: a stop takes effect
within the step that produced it. A token that cannot be committed (its grammar rejects
it, a detokenizer fails) fails that request only; the others go on.

The scheduler schedules and frees; this module decides, token by token, when a request
is done (`Scheduler.finish_request` frees it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from .metrics import IterationStats
from .request import LogprobInfo, Request, RequestStatus
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput, StepUpdate

logger = logging.getLogger(__name__)


def commit_step(
    scheduler: Scheduler,
    out: SchedulerOutput,
    sampled: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[LogprobInfo | None]] | None = None,
    iteration: IterationStats | None = None,
) -> StepUpdate:
    """Commit a step: advance computed counts, then append each request's new tokens one
    by one, checking every stop condition after each, and finish what stopped.

    sampled[i] are the tokens of out.scheduled[i] in order (empty when the step only
    computed part of its prompt); logprobs[i] has one entry per token, when given. For a
    request that ran draft tokens, sampled[i] is the accepted drafts and then one more
    token."""
    update = StepUpdate()
    now = time.monotonic()
    for index, (item, tokens) in enumerate(zip(out.scheduled, sampled)):
        request = item.request
        if request.is_finished:  # aborted while the step ran
            continue
        scheduler.advance(item, len(tokens))
        if not tokens:
            continue
        infos = logprobs[index] if logprobs is not None else None
        try:
            for position, token in enumerate(tokens):
                info = infos[position] if infos is not None else None
                if _commit_token(scheduler, request, token, info, now, iteration):
                    break
        except Exception as error:  # one request's fault ends that request only
            logger.exception("request %s failed", request.request_id)
            update.failed.append((request, f"{type(error).__name__}: {error}"))
        update.changed.append(request)
    return update


def _commit_token(
    scheduler: Scheduler,
    request: Request,
    token: int,
    info: LogprobInfo | None,
    now: float,
    iteration: IterationStats | None,
) -> bool:
    """Append one token and apply every stop condition; True when the request ended."""
    request.append_output_token(token)
    if iteration is not None:
        _count(iteration, request, now)
    if request.first_token_time is None:
        request.first_token_time = now
    request.last_token_time = now
    if info is not None and request.logprobs is not None:
        request.record_logprobs(token, info)
    status = None
    if request.structured is not None:
        if not request.structured.accept_token(token):
            raise RuntimeError(f"token {token} was rejected by the request's grammar")
        if request.structured.is_terminated():
            status = RequestStatus.FINISHED_STOPPED
    stop_string = None
    if request.detokenizer is not None:
        stop_string = request.detokenizer.add_token(token)
        if stop_string is not None:
            if request.num_output_tokens >= request.sampling_params.min_tokens:
                request.stop_reason = stop_string
                status = RequestStatus.FINISHED_STOPPED
            else:
                stop_string = None
    status = status or check_stop(request, scheduler.max_model_len)
    if status is None:
        return False
    if stop_string is None and request.detokenizer is not None:
        request.detokenizer.flush()
    scheduler.finish_request(request, status)
    return True


def _count(iteration: IterationStats, request: Request, now: float) -> None:
    """A token's share of the step's statistics (before the request's times move)."""
    if request.first_token_time is None:
        iteration.time_to_first_tokens.append(now - request.arrival_time)
        iteration.num_prompt_tokens += request.num_prompt_tokens
    else:
        iteration.inter_token_latencies.append(now - (request.last_token_time or now))
    iteration.num_generation_tokens += 1


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Stop conditions that need only token ids (stop strings are the detokenizer's)."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in params._eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:  # type: ignore[operator]  # a list once validated
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
