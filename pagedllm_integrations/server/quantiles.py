"""Quantiles from a Prometheus histogram's cumulative buckets, as PromQL's
`histogram_quantile` computes them: find the bucket the rank falls in and interpolate
linearly inside it. `pagedllm top` uses it on the buckets observed between two scrapes."""

from __future__ import annotations

import math


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile (0 <= q <= 1) of cumulative `buckets` {upper bound: count}; None when
    there are no observations. Observations in the +Inf bucket answer the largest finite
    bound (as Prometheus does)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_delta(current: dict[float, float], previous: dict[float, float]) -> dict[float, float]:
    """The buckets of the observations made between two scrapes."""
    return {bound: max(count - previous.get(bound, 0.0), 0.0) for bound, count in current.items()}
