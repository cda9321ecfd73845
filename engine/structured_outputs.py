"""Constrained decoding: a grammar restricts which tokens each step may sample.

Backend: xgrammar (chosen over llguidance on measured evidence: ~8x cheaper per-token masks on
the SmolLM2 vocabulary, the same JSON-schema coverage; see BENCHMARKS.md). Only this file
imports it, and only when a request is constrained.

Flow (see engine/llm_engine.py and engine/sampler.py):
- caller's thread, at submission: `StructuredOutputManager.compile(spec)` turns a
  `StructuredOutputsParams` into a compiled grammar (ValueError if it cannot be compiled, so a
  bad schema never reaches the engine thread), cached by a canonical key. The compile itself
  runs on the manager's one compile thread; the caller waits within its `compile_limits`
  (a timeout, a cancel flag). `new_matcher` gives each sample its own `GrammarMatcher`
  (parser state).
- engine thread, per step: `apply_grammar_masks` fills one packed bitmask for all constrained
  rows of the batch and applies it to the logits with one op; after sampling,
  `accept_token` advances the parser and `is_terminated` says the grammar has ended (it
  accepted an EOS token, which the mask allows exactly when the grammar can end).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Separators of the generated JSON: the model's natural ", " and ": ", and no free whitespace
# (a small model given free whitespace can spend its whole token budget on newlines).
JSON_SEPARATORS = (", ", ": ")
_CACHE_SIZE = 256
# How long a caller waits for a constraint to compile (the server answers 400 past it).
DEFAULT_COMPILE_TIMEOUT_S = 10.0
_POLL_S = 0.05  # how often a waiting caller looks at its cancel flag
_MAX_ERROR_CHARS = 300  # of the grammar library's message (it may quote the whole schema)


class CompileTimeoutError(ValueError):
    """The constraint did not compile within the caller's compile timeout."""


class CompileCancelledError(Exception):
    """The caller stopped waiting for a compile (its client went away)."""


@dataclass(slots=True, frozen=True)
class CompileLimits:
    """How long the current caller waits for a compile, and what tells it to stop."""

    timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S
    cancelled: threading.Event | None = None


_LIMITS: contextvars.ContextVar[CompileLimits | None] = contextvars.ContextVar(
    "pagedllm_compile_limits", default=None
)


@contextlib.contextmanager
def compile_limits(
    timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S, cancelled: threading.Event | None = None
) -> Iterator[None]:
    """Within the block, compiles that this thread waits for give up after `timeout` seconds
    (CompileTimeoutError) or once `cancelled` is set (CompileCancelledError). The compile
    itself runs on the manager's own thread and is dropped if nobody waits for it any more."""
    token = _LIMITS.set(CompileLimits(timeout, cancelled))
    try:
        yield
    finally:
        _LIMITS.reset(token)


@dataclass(slots=True)
class _PendingCompile:
    future: concurrent.futures.Future
    waiters: int = 0


@dataclass(slots=True, frozen=True)
class CompiledStructure:
    """A compiled grammar plus the canonical key it is cached under."""

    key: tuple[str, str]
    grammar: Any  # xgrammar.CompiledGrammar


class GrammarMatcher:
    """The parser state of one constrained sample (one per sequence, engine thread only)."""

    __slots__ = ("_matcher", "_rejected", "vocab_size")

    def __init__(self, compiled: CompiledStructure, vocab_size: int):
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


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and hands out matchers. Thread-safe.

    Compiles run one at a time on the manager's own thread, with xgrammar itself on one
    thread: a hostile schema costs at most one core, never the engine thread's, and never
    the event loop of a server. A caller waits for its compile within the limits of
    `compile_limits` (a timeout, a cancel flag); two callers of the same constraint share
    one compile, and a compile nobody waits for any more is dropped before it starts.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None
    ):
        import xgrammar as xgr

        # The model's vocabulary may be wider than the tokenizer's (padding rows); xgrammar
        # treats the ids past the tokenizer as special tokens that are never allowed.
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        stop = sorted({int(t) for t in stop_token_ids}) if stop_token_ids else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
        )
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False, max_threads=1)
        self._cache: OrderedDict[tuple[str, str], CompiledStructure] = OrderedDict()
        self._pending: dict[tuple[str, str], _PendingCompile] = {}
        # Reentrant: a future's done callback (`_settle`) runs at once in the thread that
        # adds it to a finished future, or that cancels it, which holds the lock then.
        self._lock = threading.RLock()
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pagedllm-grammar"
        )

    def compile(self, spec: StructuredOutputsParams) -> CompiledStructure:
        """Compile (or fetch from the cache) the grammar of one constraint.

        Raises ValueError when the schema / regex / grammar cannot be compiled,
        CompileTimeoutError (a ValueError) past the caller's timeout, and
        CompileCancelledError once the caller's cancel flag is set.
        """
        key = canonical_key(spec)
        limits = _LIMITS.get() or CompileLimits()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._pending.get(key)
            if pending is None:
                pending = _PendingCompile(self._worker.submit(self._compile_job, key))
                self._pending[key] = pending
                pending.future.add_done_callback(lambda f, key=key: self._settle(key, f))
            pending.waiters += 1
        try:
            return self._wait(pending.future, key[0], limits)
        finally:
            with self._lock:
                pending.waiters -= 1
                if pending.waiters == 0:
                    pending.future.cancel()  # a no-op once the compile has started

    def _wait(
        self, future: concurrent.futures.Future, kind: str, limits: CompileLimits
    ) -> CompiledStructure:
        deadline = None if limits.timeout is None else time.monotonic() + limits.timeout
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except concurrent.futures.TimeoutError:
                pass
            except concurrent.futures.CancelledError:
                raise CompileCancelledError("the compile was cancelled") from None
            if limits.cancelled is not None and limits.cancelled.is_set():
                raise CompileCancelledError("the caller stopped waiting for the compile")
            if deadline is not None and time.monotonic() >= deadline:
                raise CompileTimeoutError(
                    f"the structured_outputs {kind} constraint did not compile within "
                    f"{limits.timeout:g} s (the compile timeout); simplify the schema or grammar"
                )

    def _compile_job(self, key: tuple[str, str]) -> CompiledStructure:
        try:
            grammar = self._compile(*key)
        except ValueError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError and friends
            message = str(error)
            if len(message) > _MAX_ERROR_CHARS:
                message = message[:_MAX_ERROR_CHARS] + "..."
            raise ValueError(
                f"cannot compile the structured_outputs {key[0]} constraint: {message}"
            ) from None
        return CompiledStructure(key, grammar)

    def _settle(self, key: tuple[str, str], future: concurrent.futures.Future) -> None:
        """A compile ended (done, failed or cancelled): cache it, forget it as pending."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None and pending.future is future:
                del self._pending[key]
            if future.cancelled() or future.exception() is not None:
                return
            self._cache[key] = future.result()
            self._cache.move_to_end(key)
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)

    def new_matcher(self, compiled: CompiledStructure) -> GrammarMatcher:
        return GrammarMatcher(compiled, self.vocab_size)

    def _compile(self, kind: str, text: str) -> Any:
        if kind == "json":
            return self.compiler.compile_json_schema(
                text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
            )
        if kind == "json_object":
            # Not strict: any object, any properties.
            return self.compiler.compile_json_schema(
                text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
            )
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind in ("choice", "ebnf"):
            return self.compiler.compile_grammar(text, root_rule_name="root")
        if kind == "lark":
            return self.compiler.compile_lark(text)
        raise ValueError(f"unknown structured_outputs kind {kind!r}")


def canonical_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical text) of a constraint: equal constraints give equal keys."""
    if spec.json is not None:
        # Key order is kept: xgrammar emits properties in schema order.
        return "json", json.dumps(schema_dict(spec.json), separators=(",", ":"))
    if spec.json_object:
        return "json_object", '{"type": "object"}'
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        # Alternatives as EBNF string literals (JSON escaping is valid EBNF escaping).
        return "choice", "root ::= " + " | ".join(json.dumps(c) for c in spec.choice)
    assert spec.grammar is not None
    grammar = spec.grammar.strip()
    return ("ebnf" if "::=" in grammar else "lark"), grammar


def schema_dict(schema: Any) -> dict:
    """A JSON schema given as a dict, a JSON string or a pydantic model class, as a dict."""
    if isinstance(schema, dict):
        return schema
    if isinstance(schema, str):
        try:
            loaded = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from error
        if not isinstance(loaded, dict):
            raise ValueError("structured_outputs.json must be a JSON object (a schema)")
        return loaded
    model_json_schema = getattr(schema, "model_json_schema", None)
    if isinstance(schema, type) and callable(model_json_schema):
        return model_json_schema()
    raise ValueError(
        "structured_outputs.json must be a schema dict, a JSON string or a pydantic model "
        f"class, got {type(schema).__name__}"
    )


def tagged_json_grammar(
    alternatives: Sequence[tuple[str, dict, str]],
    repeat_separator: str | None = None,
    max_repeats: int | None = None,
) -> str:
    """An EBNF grammar (xgrammar's dialect) for `before + JSON + after`, one alternative.

    alternatives: (before, JSON schema, after) triples; the JSON is generated the same way as a
    `json` constraint. With `repeat_separator`, one or more matches (at most `max_repeats`)
    joined by that separator.
    Used for forced tool calls (engine/tool_calls.py). ValueError for a schema that cannot be
    compiled.
    """
    import xgrammar as xgr

    if not alternatives:
        raise ValueError("tagged_json_grammar needs at least one alternative")
    try:
        options = []
        for before, schema, after in alternatives:
            parts = [
                _literal_grammar(before),
                xgr.Grammar.from_json_schema(
                    json.dumps(schema),
                    any_whitespace=False,
                    separators=JSON_SEPARATORS,
                    strict_mode=True,
                ),
                _literal_grammar(after),
            ]
            options.append(xgr.Grammar.concat(*parts))
        grammar = options[0] if len(options) == 1 else xgr.Grammar.union(*options)
    except Exception as error:
        raise ValueError(f"cannot build a grammar from the tool schemas: {error}") from error
    text = str(grammar)
    if repeat_separator is None:
        return text
    # The top rule of a concat/union is never referenced by the other rules (sub-grammar roots
    # are renamed), so it can be renamed and repeated.
    lines = text.splitlines()
    tops = [i for i, line in enumerate(lines) if line.startswith("root ::= ")]
    if len(tops) != 1:
        raise ValueError("cannot repeat the tool-call grammar: unexpected rule layout")
    item = "tagged_json_item"
    while any(line.startswith(f"{item} ::= ") for line in lines):
        item += "_"
    lines[tops[0]] = item + lines[tops[0]][len("root") :]
    more = "*" if max_repeats is None else f"{{0, {max(int(max_repeats), 1) - 1}}}"
    lines.append(f"root ::= {item} ({json.dumps(repeat_separator)} {item}){more}")
    return "\n".join(lines)


def _literal_grammar(text: str) -> Any:
    import xgrammar as xgr

    # JSON string escaping is valid in xgrammar's EBNF string literals.
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}" if text else 'root ::= ""')


def wrap_grammar(grammar: str, before: str, after: str) -> str:
    """root ::= before <grammar's root> after (xgrammar's EBNF, rule names kept unique)."""
    lines = grammar.splitlines()
    tops = [i for i, line in enumerate(lines) if line.startswith("root ::= ")]
    if len(tops) != 1:
        raise ValueError("cannot wrap the tool-call grammar: unexpected rule layout")
    inner = "wrapped_calls"
    while any(line.startswith(f"{inner} ::= ") for line in lines):
        inner += "_"
    lines[tops[0]] = inner + lines[tops[0]][len("root") :]
    lines.append(f"root ::= {json.dumps(before)} {inner} {json.dumps(after)}")
    return "\n".join(lines)
