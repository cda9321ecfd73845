"""Bounds on what one request may hand the engine, checked before any work is done on it.

A JSON schema (a tool's parameters, a structured output), a regex or a grammar comes from
the caller; compiling it, copying it or printing it recurses on its depth and takes time in
its size. Each check here runs once, iteratively (no recursion on caller-controlled depth),
on the caller's thread, and raises a ValueError that names the limit (the server answers
400 with it). Text the tokenizer cannot take (a lone UTF-16 surrogate) is refused here too.
"""

from __future__ import annotations

import re
from typing import Any

# Nesting of objects and arrays in one JSON schema. A schema level is usually two of them
# ({"properties": {"name": <schema>}}): 64 allows ~30 nested object levels.
MAX_JSON_DEPTH = 64
# Values (objects, arrays, strings, numbers...) in the schemas of one request, all tools
# together: far beyond a large real tool set, far below what makes compiling slow.
MAX_JSON_NODES = 10_000
MAX_TOOLS = 128
# Characters of a regex, an EBNF / Lark grammar, or of all `choice` strings together.
MAX_GRAMMAR_CHARS = 64 * 1024
# The largest count in a repetition {n}, {n,} or {n,m} of a regex or grammar: the grammar
# compiler unrolls counted repetitions, so `.{1,50000}` alone takes seconds.
MAX_REPETITION = 1000

_REPETITION = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def check_text(text: str, what: str) -> None:
    """ValueError when `text` cannot be encoded as UTF-8 (it holds a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise ValueError(
            f"{what} contains a lone UTF-16 surrogate (U+{code:04X} at character {error.start}); "
            "text must be valid Unicode"
        ) from None


def check_repetitions(pattern: str, what: str) -> None:
    """ValueError when a counted repetition in a regex or grammar exceeds MAX_REPETITION."""
    for match in _REPETITION.finditer(pattern):
        counts = [int(c) for c in match.groups() if c]
        if counts and max(counts) > MAX_REPETITION:
            raise ValueError(
                f"{what} repeats {max(counts)} times in {match.group(0)!r}; the limit is "
                f"{MAX_REPETITION} repetitions"
            )


def check_grammar_text(text: str, what: str) -> None:
    """A regex or grammar: its length, its repetition counts and its text."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(
            f"{what} has {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS} characters"
        )
    check_text(text, what)
    check_repetitions(text, what)


class SchemaBudget:
    """Counts the JSON values of every schema of one request against MAX_JSON_NODES."""

    def __init__(self, max_nodes: int = MAX_JSON_NODES):
        self.max_nodes = max_nodes
        self.used = 0

    def check(self, schema: Any, what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
        """Walk `schema` without recursion: its depth, its size (added to this budget), its
        strings (valid Unicode) and its regex patterns (repetition counts); ValueError
        naming the limit that is passed."""
        stack: list[tuple[Any, int]] = [(schema, 1)]
        while stack:
            value, depth = stack.pop()
            self.used += 1
            if self.used > self.max_nodes:
                raise ValueError(
                    f"{what}: the schemas of this request hold more than {self.max_nodes} JSON "
                    f"values; the limit is {self.max_nodes}"
                )
            if isinstance(value, dict | list | tuple):
                if depth > max_depth:
                    raise ValueError(
                        f"{what} is nested more than {max_depth} levels deep (objects and "
                        f"arrays); the limit is {max_depth} levels"
                    )
                if isinstance(value, dict):
                    for key, item in value.items():
                        if not isinstance(key, str):
                            raise ValueError(f"{what}: object keys must be strings, got {key!r}")
                        check_text(key, what)
                        if key == "pattern" and isinstance(item, str):
                            check_grammar_text(item, f"{what} (pattern)")
                        stack.append((item, depth + 1))
                else:
                    stack.extend((item, depth + 1) for item in value)
            elif isinstance(value, str):
                check_text(value, what)
            elif value is not None and not isinstance(value, bool | int | float):
                raise ValueError(f"{what} must hold only JSON values, got a {type(value).__name__}")


def check_schema(schema: Any, what: str) -> None:
    """One schema on its own budget (see `SchemaBudget.check`)."""
    SchemaBudget().check(schema, what)
