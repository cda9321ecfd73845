"""Grammar masks on the engine thread: one parser state per constrained sample, and the
packed bitmasks that restrict the logits of a batch's constrained rows (xgrammar).

Per step (see engine/sampler.py): `apply_grammar_masks` fills one packed bitmask for all
constrained rows of the batch and applies it to the logits with one op; after sampling,
`GrammarMatcher.accept_token` advances the parser and `is_terminated` says the grammar has
ended (it accepted an EOS token, which the mask allows exactly when the grammar can end).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch


class GrammarMatcher:
    """The parser state of one constrained sample (one per sequence, engine thread only)."""

    __slots__ = ("_matcher", "_rejected", "vocab_size")

    def __init__(self, compiled: Any, vocab_size: int):
        """compiled: a structured_outputs.CompiledStructure."""
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self.vocab_size = vocab_size
        self._rejected = False

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask: int32 [rows, ceil(vocab / 32)] on CPU; bit j of row set = token j allowed."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def mask_logits(self, logits_row: torch.Tensor) -> None:
        """logits_row: float [vocab]; sets the logits of disallowed tokens to -inf in place."""
        apply_grammar_masks(logits_row[None, :], [0], [self])

    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        if self._rejected:
            return False
        ok = bool(self._matcher.accept_token(int(token)))
        self._rejected = not ok
        return ok

    def is_terminated(self) -> bool:
        """True once the grammar has ended (it accepted a stop token)."""
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def fill_draft_bitmasks(
        self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]
    ) -> tuple[int, int]:
        """Speculative decoding: the masks along a run of draft tokens.

        Row first_row + j of bitmask (int32 [rows, ceil(vocab / 32)]) gets the mask after
        drafts[:j], for each j the grammar reaches: it stops after the first draft it
        refuses or after one that ends it. The parser state is as before on return.
        Returns (drafts accepted in a row, rows filled).
        """
        matcher = self._matcher
        accepted = filled = 0
        for j in range(len(drafts) + 1):
            matcher.fill_next_token_bitmask(bitmask, first_row + j)
            filled += 1
            if j == len(drafts) or not matcher.accept_token(int(drafts[j])):
                break
            accepted += 1
            if matcher.is_terminated():
                break
        if accepted:
            matcher.rollback(accepted)
        return accepted, filled


def apply_grammar_masks(
    logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]
) -> None:
    """Mask the constrained rows of a batch in place with one packed bitmask.

    logits: float [N, V] (any device); rows: the batch rows that are constrained, with
    matchers[i] the matcher of logits[rows[i]]. Rows not listed are left untouched.
    """
    if not rows:
        return
    width = matchers[0].bitmask_width
    # Rows of the bitmask follow the rows of the logits (xgrammar's `indices` convention);
    # rows outside `rows` are never read.
    bitmask = torch.empty(logits.shape[0], width, dtype=torch.int32)
    if len(matchers) == 1:
        matchers[0].fill_bitmask(bitmask, rows[0])
    else:
        _batch_matcher().batch_fill_next_token_bitmask(
            [m._matcher for m in matchers], bitmask, list(rows)
        )
    _apply_bitmask(logits, bitmask, rows)


def apply_draft_grammar_masks(
    logits: torch.Tensor,
    first_rows: Sequence[int],
    matchers: Sequence[GrammarMatcher],
    drafts: Sequence[Sequence[int]],
) -> list[int]:
    """Mask the rows of constrained sequences that verify draft tokens, in place.

    Sequence i owns rows first_rows[i] .. first_rows[i] + len(drafts[i]) of logits [N, V]:
    row j is masked for its grammar's state after drafts[i][:j] (see
    `GrammarMatcher.fill_draft_bitmasks`). Returns, per sequence, how many of its drafts
    the grammar accepts in a row: a later draft can never be accepted.
    """
    if not matchers:
        return []
    bitmask = torch.empty(logits.shape[0], matchers[0].bitmask_width, dtype=torch.int32)
    rows: list[int] = []
    limits: list[int] = []
    for first, matcher, tokens in zip(first_rows, matchers, drafts):
        accepted, filled = matcher.fill_draft_bitmasks(bitmask, first, tokens)
        rows.extend(range(first, first + filled))
        limits.append(accepted)
    _apply_bitmask(logits, bitmask, rows)
    return limits


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """logits[rows] of disallowed tokens to -inf; bitmask int32 [N, width] on CPU."""
    import xgrammar as xgr

    width = bitmask.shape[1]
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    # Ids past the bitmask (a model vocabulary wider than the tokenizer's) are masked too:
    # they have no text, so no grammar can accept them.
    covered = width * 32
    if logits.shape[1] > covered:
        logits[list(rows), covered:] = float("-inf")
    xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=min(logits.shape[1], covered), indices=list(rows)
    )


_BATCH = threading.local()


def _batch_matcher():
    """One xgrammar BatchGrammarMatcher per thread (it owns a worker pool)."""
    matcher = getattr(_BATCH, "matcher", None)
    if matcher is None:
        import xgrammar as xgr

        matcher = _BATCH.matcher = xgr.BatchGrammarMatcher()
    return matcher
