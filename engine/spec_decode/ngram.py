"""Prompt lookup: draft the tokens that followed an earlier occurrence of the sequence's tail.

For a sequence t_0 .. t_{L-1} (prompt, then outputs) and n from prompt_lookup_max down to
prompt_lookup_min, the last n tokens t_{L-n} .. t_{L-1} are looked up among the n-grams
that end before position L-1; at the first (longest) n that occurs, the earliest
occurrence, ending at e, gives the draft t_{e+1} .. t_{e+d}. This is vLLM's rule (longest
match, earliest position).

    tokens:   ... the deposit is 50 euros per bike ...  How big is the deposit? The deposit is
    tail n=3:                                                              "The deposit is"
    earliest match of "deposit is" (n=2) -> draft "50 euros per bike"

How many tokens (d): vLLM's n-gram method always drafts num_speculative_tokens (k). A short
match is a weak prediction, though: on the RAG benchmark's answers, where the tail matched
only 2 tokens back the first draft token was right half the time and the fourth a quarter
of the time; where it matched 12 or more, the first was right 96% of the time and the
seventh 80%. Each drafted token costs a query row of the verifying step (~0.15-0.2 of a
one-row step on a 2-core CPU), so pagedllm drafts at most max_spec_factor * n tokens, as
vLLM's suffix decoding bounds its drafts by its suffix_decoding_max_spec_factor:
d = min(k, floor(max_spec_factor * n)), fewer where the sequence ends sooner.
max_spec_factor None is vLLM's n-gram rule, d = k.

The index: every prompt_lookup_min-gram of the sequence maps to the ends of its occurrences
(in order), built once over the prompt and extended by the few tokens each step appends.
A proposal looks up the tail's prompt_lookup_min-gram and walks its occurrences, earliest
first, counting how far back each matches the tail (up to prompt_lookup_max); the first to
match furthest is vLLM's choice. The walk stops as soon as one matches prompt_lookup_max
tokens, so a sequence that repeats itself costs no more than one that does not, and it
walks at most the first MAX_OCCURRENCES occurrences, so a min-gram that occurs thousands of
times in a long context (`", "` in JSON) costs a proposal tens of microseconds, not
milliseconds. Past that many occurrences the draft can differ from vLLM's (a longer match
further on is not seen); outputs never do, drafts only decide the speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request
from .config import SpeculativeConfig

MAX_OCCURRENCES = 64  # of the tail's min-gram, walked per proposal (see above)


@dataclass(slots=True)
class NgramIndex:
    """The prompt_lookup_min-grams of tokens[: num_indexed] (all that end before the newest
    token) -> the positions where they end, ascending."""

    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending at positions < num_indexed are in ends


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_spec_factor = config.max_spec_factor

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
        occurrences = index.ends.get(tuple(tokens[length - self.min_n :]))
        if occurrences is None:
            return []
        longest = min(self.max_n, length - 1)
        best_end, best_n = -1, 0
        last = length - 1
        for end in occurrences[:MAX_OCCURRENCES]:  # earliest first: ties keep the earliest
            n = self.min_n  # the min-gram itself matches
            while n < longest and n <= end and tokens[end - n] == tokens[last - n]:
                n += 1
            if n > best_n:
                best_end, best_n = end, n
                if n == longest:
                    break
        if self.max_spec_factor is not None:
            limit = min(limit, int(self.max_spec_factor * best_n))
        return tokens[best_end + 1 : best_end + 1 + limit]

    def _extend(self, index: NgramIndex, tokens: list[int], upto: int) -> None:
        """Add the min-grams that end at positions index.num_indexed .. upto - 1."""
        ends, n = index.ends, self.min_n
        for end in range(max(index.num_indexed, n - 1), upto):
            key = tuple(tokens[end + 1 - n : end + 1])
            found = ends.get(key)
            if found is None:
                ends[key] = [end]
            else:
                found.append(end)
        index.num_indexed = max(index.num_indexed, upto)
