"""Prompt lookup: draft the tokens that followed an earlier occurrence of the sequence's tail.

For a sequence t_0 .. t_{L-1} (prompt, then outputs) and n from prompt_lookup_max down to
prompt_lookup_min, the last n tokens t_{L-n} .. t_{L-1} are looked up among the n-grams
that end before position L-1; at the first (longest) n that occurs, the earliest
occurrence, ending at e, gives the draft t_{e+1} .. t_{e+k} (fewer when the sequence ends
sooner). This is vLLM's rule (longest match, earliest position).

    tokens:   ... the deposit is 50 euros per bike ...  How big is the deposit? The deposit is
    tail n=3:                                                              "The deposit is"
    earliest match of "deposit is" (n=2) -> draft "50 euros per bike"

Each sequence keeps an index {n-gram: end of its first occurrence} on its `Request`, built
once over the prompt and extended by the few tokens each step appends, so a proposal costs
a few dictionary look-ups, not a scan of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request
from .config import SpeculativeConfig


@dataclass(slots=True)
class NgramIndex:
    """The n-grams of tokens[: num_indexed] (all that end before the newest token)."""

    first_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending at positions < num_indexed are in first_end


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, request: Request, max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) draft tokens for the position after the sequence's last
        token ([] when its tail occurs nowhere earlier)."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = request.all_token_ids
        length = len(tokens)
        if limit <= 0 or length <= self.min_n:
            return []
        index = request.draft_index
        if index is None:
            index = request.draft_index = NgramIndex()
        self._extend(index, tokens, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.first_end.get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + limit]
        return []

    def _extend(self, index: NgramIndex, tokens: list[int], upto: int) -> None:
        """Add the n-grams that end at positions index.num_indexed .. upto - 1."""
        first_end = index.first_end
        for end in range(index.num_indexed, upto):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                first_end.setdefault(tuple(tokens[end + 1 - n : end + 1]), end)
        index.num_indexed = max(index.num_indexed, upto)
