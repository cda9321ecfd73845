"""`scheduling_policy="short_first"`: the request with the least work left runs first, aged so
that no request waits without bound.

A request's work is its prompt tokens not yet computed plus the output tokens it may still
produce (its `max_tokens` left, or `DEFAULT_EXPECTED_OUTPUT` when it gave none). Ordering by
work alone would starve a long request under a steady stream of short ones, so the key is a
virtual deadline:

    deadline = arrival_time + work / aging_tokens_per_s

which is "least work first" where arrival times are close, and "first come first served"
where they are far apart. The bound this gives: a request R is served before every request
that arrived after `R.deadline`, because each of those has a later deadline still. So only
requests that arrived before `R.arrival_time + R.work / aging_tokens_per_s` can ever run
ahead of R, and R's wait is bounded by the time those take (the aging test checks it).

The key of a waiting request is fixed while it waits (its work changes only while it runs),
so the scheduler keeps the waiting queue sorted by insertion, as for the other policies; a
running request's key shrinks as its prompt is computed, so a half-done long prompt ranks
ahead of a new one of the same length.

With this policy a waiting request that ranks ahead of a running request still in its
prefill is given its tokens first (`yields_prefill`): a 4k-token prompt being prefilled in
chunks does not keep a 50-token chat waiting for all of its chunks.
"""

from __future__ import annotations

from .request import Request
from .scheduler_policy import SchedulingPolicy

DEFAULT_EXPECTED_OUTPUT = 256  # output tokens assumed for a request without max_tokens
# Work tokens a second of waiting is worth: below the prefill speed of a small model on a
# 2-core CPU (~300 tokens/s), so that a short request is not queued behind the last chunks of
# a long prompt that has aged past it. A 4k-token prompt with 256 tokens out is passed only
# by requests that arrive within 145 s of it. In a simulation of benchmarks/latency_mix.py's
# load (0.003 s per token, 80% load) 100 gave the short requests a P99 TTFT of 8.4 s, 30 gave
# 4.6 s (fcfs: 22.7 s), with the long ones' TTFT unchanged.
DEFAULT_AGING_TOKENS_PER_S = 30.0


def remaining_work(request: Request, default_output: int = DEFAULT_EXPECTED_OUTPUT) -> int:
    """Prompt tokens not computed yet plus output tokens it may still produce."""
    prompt_left = max(request.num_prompt_tokens - request.num_computed_tokens, 0)
    max_tokens = request.sampling_params.max_tokens
    expected = max_tokens if max_tokens is not None else default_output
    return prompt_left + max(expected - request.num_output_tokens, 0)


class ShortFirstPolicy(SchedulingPolicy):
    """Least remaining work first, with aging (see the module's docstring)."""

    name = "short_first"
    yields_prefill = True

    def __init__(
        self,
        aging_tokens_per_s: float = DEFAULT_AGING_TOKENS_PER_S,
        default_output: int = DEFAULT_EXPECTED_OUTPUT,
    ) -> None:
        if not aging_tokens_per_s > 0:
            raise ValueError(f"aging_tokens_per_s must be > 0, got {aging_tokens_per_s}")
        if default_output < 0:
            raise ValueError(f"default_output must be >= 0, got {default_output}")
        self.aging_tokens_per_s = float(aging_tokens_per_s)
        self.default_output = default_output

    def deadline(self, request: Request) -> float:
        work = remaining_work(request, self.default_output)
        return request.arrival_time + work / self.aging_tokens_per_s

    def sort_key(self, request: Request) -> tuple:
        return (self.deadline(request), request.arrival_seq)
