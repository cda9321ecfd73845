"""One request's fault while sampling a step fails that request, not the whole step.

The sampler works on the batch: one [N, vocab] tensor, one grammar bitmask for every
constrained row. An exception raised there for one row (its grammar matcher raising, a
value that validation at submission did not catch) would otherwise fail all N requests.
`sample_rows` retries instead: the step's logits are computed again (the failed attempt may
have masked rows in place), each row is sampled on its own to find the ones that raise, and
the others are sampled together once more, with every generator rewound to where it was
before the step, so a seeded neighbour draws exactly the tokens it would have drawn alone.

Nothing is paid on the normal path but saving the state of the seeded rows' generators.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .request import Request
from .sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)


def sample_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: list[Request],
    recompute_logits: Callable[[], torch.Tensor],
) -> tuple[SamplerOutput, dict[int, str]]:
    """Sample one token per row of logits [N, vocab]; (output, {row: why it failed}).

    A failed row's token is a placeholder (0) that the caller must not commit. Raises when
    the failure cannot be pinned on rows (the batch fails again without them): the caller
    then fails the step.
    """
    generators = _generators(sampler, requests)
    states = [g.get_state() for g in generators]
    try:
        return sampler(logits, requests), {}
    except Exception:
        logger.warning(
            "sampling a step of %d rows raised; sampling each row alone", len(requests),
            exc_info=True,
        )  # fmt: skip
    logits = recompute_logits()
    failed: dict[int, str] = {}
    for row, request in enumerate(requests):
        _rewind(generators, states)
        try:
            sampler(logits[row : row + 1].clone(), [request])
        except Exception as error:
            failed[row] = f"{type(error).__name__}: {error}"
            logger.warning("request %s failed in the sampler: %r", request.request_id, error)
    _rewind(generators, states)
    token_ids = [0] * len(requests)
    logprobs: list = [None] * len(requests)
    good = [row for row in range(len(requests)) if row not in failed]
    if good:
        again = sampler(logits[good], [requests[row] for row in good])
        for position, row in enumerate(good):
            token_ids[row] = again.token_ids[position]
            logprobs[row] = again.logprobs[position]
    return SamplerOutput(token_ids, logprobs), failed


def _generators(sampler: Sampler, requests: list[Request]) -> list[torch.Generator]:
    """The sampler's own generator (unseeded rows) and each seeded row's, once each."""
    found = [sampler.generator]
    for request in requests:
        if request.generator is not None and all(g is not request.generator for g in found):
            found.append(request.generator)
    return found


def _rewind(generators: list[torch.Generator], states: list[torch.Tensor]) -> None:
    for generator, state in zip(generators, states):
        generator.set_state(state)
