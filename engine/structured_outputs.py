"""Constrained decoding: a grammar restricts which tokens each step may sample.

Backend: xgrammar (chosen over llguidance on measured evidence: ~8x cheaper per-token masks on
the SmolLM2 vocabulary, the same JSON-schema coverage; see BENCHMARKS.md). Only this file,
engine/grammar_masks.py and the compiler process import it, and only when a request is
constrained.

Flow (see engine/llm_engine.py and engine/sampler.py):
- caller's thread, at submission: `StructuredOutputManager.compile(spec)` turns a
  `StructuredOutputsParams` into a compiled grammar (ValueError if it cannot be compiled, so a
  bad schema never reaches the engine thread), cached by a canonical key. A JSON schema is
  first checked for keywords the grammar would not enforce (engine/schema_support.py).
- the compile itself runs in a child of the compiler process (engine/grammar_compile_worker.py),
  one child per compile: compiles of different clients run side by side, and one that nobody
  waits for any more (its caller's timeout passed, its client left) is killed, not left to
  run. The caller waits within its `compile_limits` (a timeout, a cancel flag).
- bounded in bytes: a grammar bigger than `max_grammar_bytes` is refused (its compiled cost,
  not its text, is what a request may spend), and the cache of compiled grammars is an LRU
  bounded by `cache_max_bytes` in all.
- engine thread, per step: the masks of engine/grammar_masks.py (`new_matcher` gives each
  sample its own `GrammarMatcher`).
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
from dataclasses import dataclass, field
from typing import Any

from .grammar_compile_service import (
    STARTUP_TIMEOUT_S,
    CompileJob,
    CompilerUnavailableError,
    GrammarCompileService,
    shared_service,
)
from .grammar_compile_worker import JSON_SEPARATORS
from .grammar_masks import GrammarMatcher, apply_draft_grammar_masks, apply_grammar_masks
from .sampling_params import StructuredOutputsParams
from .schema_support import check_enforceable, has_lookaround

__all__ = [
    "JSON_SEPARATORS",
    "CompileCancelledError",
    "CompileTimeoutError",
    "CompiledStructure",
    "GrammarMatcher",
    "StructuredOutputManager",
    "apply_draft_grammar_masks",
    "apply_grammar_masks",
    "canonical_key",
    "compile_limits",
    "schema_dict",
    "tagged_json_grammar",
    "wrap_grammar",
]

logger = logging.getLogger(__name__)

# How long a caller waits for a constraint to compile (the server answers 400 past it).
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# The largest compiled grammar one constraint may make. Real schemas compile to well under
# 1 MiB (the 20 of tests/test_structured_outputs.py: 0.2 MiB at most); an enum of 400 strings
# of 1,000 characters makes 104 MiB.
DEFAULT_MAX_GRAMMAR_BYTES = 32 << 20
# All compiled grammars kept for reuse (least recently used dropped first).
DEFAULT_CACHE_MAX_BYTES = 256 << 20
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
    (CompileTimeoutError) or once `cancelled` is set (CompileCancelledError). A compile that
    nobody waits for any more is killed. The time the compiler process takes to start (once
    per process, seconds) does not count against the timeout."""
    token = _LIMITS.set(CompileLimits(timeout, cancelled))
    try:
        yield
    finally:
        _LIMITS.reset(token)


@dataclass(slots=True, frozen=True)
class CompiledStructure:
    """A compiled grammar plus the canonical key it is cached under.

    It travels inside an `EngineRequest`. Pickled (to a Ray replica) it becomes xgrammar's
    serialized form (`serialized`, with `grammar` None), which the receiving engine turns
    back into a grammar against its own tokenizer (`StructuredOutputManager.adopt`)
    instead of compiling the constraint a second time.
    """

    key: tuple[str, str]
    grammar: Any  # xgrammar.CompiledGrammar; None in a copy received from another process
    nbytes: int = 0  # its memory, as xgrammar counts it
    serialized: str | None = field(default=None, repr=False)

    def __reduce__(self) -> tuple:
        payload = self.serialized if self.grammar is None else self.grammar.serialize_json()
        return (_received_structure, (self.key, self.nbytes, payload))


def _received_structure(key: tuple[str, str], nbytes: int, serialized: str) -> CompiledStructure:
    return CompiledStructure(tuple(key), None, nbytes, serialized)  # type: ignore[arg-type]


@dataclass(slots=True, eq=False)
class _PendingCompile:
    job: CompileJob
    waiters: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    compiled: CompiledStructure | None = None  # deserialized by the first waiter


class GrammarCache:
    """Compiled grammars by key, least recently used first out, within `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, str], CompiledStructure] = OrderedDict()

    def get(self, key: tuple[str, str]) -> CompiledStructure | None:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, compiled: CompiledStructure) -> None:
        if compiled.nbytes > self.max_bytes or compiled.key in self._entries:
            return
        self._entries[compiled.key] = compiled
        self.nbytes += compiled.nbytes
        while self.nbytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and hands out matchers. Thread-safe.

    A caller waits for its compile within the limits of `compile_limits`; two callers of the
    same constraint share one compile, and a compile nobody waits for any more is killed.
    max_grammar_bytes: the largest compiled grammar one constraint may make (ValueError past
    it); cache_max_bytes: what the cache of compiled grammars may hold in all; service: the
    compiler process to use (by default the one shared by every manager of this tokenizer).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None = None,
        *,
        max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
        cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES,
        service: GrammarCompileService | None = None,
    ):
        import xgrammar as xgr

        for name, value in (("max_grammar_bytes", max_grammar_bytes),
                            ("cache_max_bytes", cache_max_bytes)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        # The model's vocabulary may be wider than the tokenizer's (padding rows); xgrammar
        # treats the ids past the tokenizer as special tokens that are never allowed.
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        stop = sorted({int(t) for t in stop_token_ids}) if stop_token_ids else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
        )
        # The compiler process: shared by every manager of this tokenizer unless given.
        self.service = service or shared_service(self.tokenizer_info.serialize_json())
        self.max_grammar_bytes = max_grammar_bytes
        self._cache = GrammarCache(cache_max_bytes)
        self._pending: dict[tuple[str, str], _PendingCompile] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # constraints handed to the compiler process (cache misses)

    def compile(self, spec: StructuredOutputsParams) -> CompiledStructure:
        """Compile (or fetch from the cache) the grammar of one constraint.

        Raises ValueError when the schema / regex / grammar cannot be compiled (or uses a
        JSON Schema keyword the grammar would not enforce, or compiles past
        max_grammar_bytes), CompileTimeoutError (a ValueError) past the caller's timeout,
        and CompileCancelledError once the caller's cancel flag is set.
        """
        key = canonical_key(spec)
        limits = _LIMITS.get() or CompileLimits()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
        if key[0] == "json":
            check_enforceable(spec.json, "the structured_outputs.json schema")
        if key[0] == "regex" and has_lookaround(key[1]):
            raise ValueError(
                "structured_outputs.regex uses a lookahead or lookbehind ((?=, (?!, (?<=, "
                "(?<!), which the grammar cannot enforce; rewrite the regex without it"
            )
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or pending.job.future.cancelled():
                job = self.service.submit(key[0], key[1], self.max_grammar_bytes)
                self.compiles += 1
                pending = self._pending[key] = _PendingCompile(job)
            pending.waiters += 1
        try:
            return self._wait(pending, key, limits)
        finally:
            with self._lock:
                pending.waiters -= 1
                if pending.waiters == 0:
                    if self._pending.get(key) is pending:
                        del self._pending[key]
                    if not pending.job.done():
                        self.service.cancel(pending.job)  # kills its process

    def _wait(
        self, pending: _PendingCompile, key: tuple[str, str], limits: CompileLimits
    ) -> CompiledStructure:
        deadline = None
        started = time.monotonic()
        future = pending.job.future
        while True:
            if deadline is None and limits.timeout is not None and self.service.ready:
                deadline = time.monotonic() + limits.timeout  # from when compiles can run
            try:
                payload, nbytes = future.result(timeout=_POLL_S)
                break
            except concurrent.futures.TimeoutError:
                pass
            except concurrent.futures.CancelledError:
                raise CompileCancelledError("the compile was cancelled") from None
            except ValueError as error:
                raise ValueError(
                    f"cannot compile the structured_outputs {key[0]} constraint: "
                    f"{_shorten(str(error))}"
                ) from None
            if limits.cancelled is not None and limits.cancelled.is_set():
                raise CompileCancelledError("the caller stopped waiting for the compile")
            if deadline is not None and time.monotonic() >= deadline:
                raise CompileTimeoutError(
                    f"the structured_outputs {key[0]} constraint did not compile within "
                    f"{limits.timeout:g} s (the compile timeout); simplify the schema or grammar"
                )
            if not self.service.ready and time.monotonic() - started > STARTUP_TIMEOUT_S:
                raise CompilerUnavailableError(
                    f"the grammar compiler process did not start within {STARTUP_TIMEOUT_S:g} s"
                )
        return self._install(pending, key, payload, nbytes)

    def _install(
        self, pending: _PendingCompile, key: tuple[str, str], payload: str, nbytes: int
    ) -> CompiledStructure:
        """The first waiter turns the serialized grammar into one and caches it."""
        import xgrammar as xgr

        with pending.lock:
            if pending.compiled is None:
                grammar = xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)
                pending.compiled = CompiledStructure(key, grammar, nbytes)
                with self._lock:
                    self._cache.put(pending.compiled)
            return pending.compiled

    def adopt(self, compiled: CompiledStructure) -> CompiledStructure:
        """The usable form of a compiled grammar a request brought (engine thread): itself
        when it was compiled in this process; else the cached grammar of its key, or its
        serialized form deserialized against this tokenizer (no compile) and cached."""
        if compiled.grammar is not None:
            return compiled
        with self._lock:
            hit = self._cache.get(compiled.key)
        if hit is not None:
            return hit
        if compiled.serialized is None:
            raise ValueError(f"the compiled {compiled.key[0]} grammar arrived without its body")
        import xgrammar as xgr

        try:
            grammar = xgr.CompiledGrammar.deserialize_json(compiled.serialized, self.tokenizer_info)
        except Exception as error:  # xgrammar's own types: the body is not one it wrote
            raise ValueError(
                f"the compiled {compiled.key[0]} grammar this request brought cannot be read "
                f"by this engine: {_shorten(str(error))}"
            ) from None
        usable = CompiledStructure(compiled.key, grammar, compiled.nbytes)
        with self._lock:
            self._cache.put(usable)
        return usable

    @property
    def cache_bytes(self) -> int:
        """What the cached compiled grammars hold, in bytes."""
        with self._lock:
            return self._cache.nbytes

    def new_matcher(self, compiled: CompiledStructure) -> GrammarMatcher:
        return GrammarMatcher(compiled, self.vocab_size)


def _shorten(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."


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
    Used for forced tool calls (pagedllm_integrations/chat/tool_calls.py). ValueError for a schema that cannot be
    compiled, or that uses a keyword the grammar would not enforce.
    """
    import xgrammar as xgr

    if not alternatives:
        raise ValueError("tagged_json_grammar needs at least one alternative")
    for before, schema, _ in alternatives:
        check_enforceable(schema, f"the tool-call schema after {before.strip()[-60:]!r}")
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
