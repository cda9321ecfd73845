"""Per-request sampling settings, shaped like vLLM's `SamplingParams`.

Everything a caller can get wrong is checked in `__post_init__`, so a bad value is a
`ValueError` at submission time and never reaches the engine thread.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .request_limits import MAX_GRAMMAR_CHARS, check_grammar_text, check_schema, check_text

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SAMPLES = 1024  # n: the samples of one request
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; -100 already bans a token


class RequestOutputKind(enum.Enum):
    """What each streamed `RequestOutput` carries."""

    CUMULATIVE = "cumulative"  # all text and tokens so far
    DELTA = "delta"  # only what is new since the previous output
    FINAL_ONLY = "final_only"  # one output, when the request ends


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """One constraint on the generated text (exactly one field set). Frozen, as the
    request that carries it.

    json: a JSON schema (dict, JSON string, or a pydantic model class).
    json_object: any JSON object.
    regex: a regular expression the whole output must match.
    choice: the output is exactly one of these strings.
    grammar: an EBNF (GBNF) or Lark grammar.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [
            self.json is not None,
            self.json_object,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
        ]
        if sum(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {sum(kinds)}"
            )
        if self.json is not None and not isinstance(self.json, dict):
            # A JSON string or a pydantic model class becomes a schema dict here, so a bad
            # one is a ValueError when the params are built.
            from .structured_outputs import schema_dict

            object.__setattr__(self, "json", schema_dict(self.json))
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )
        # Bounds on what the grammar compiler is handed (engine/request_limits.py).
        if self.json is not None:
            check_schema(self.json, "the structured_outputs.json schema")
        for name in ("regex", "grammar"):
            text = getattr(self, name)
            if text is not None:
                if not isinstance(text, str):
                    raise ValueError(f"structured_outputs.{name} must be a string")
                check_grammar_text(text, f"structured_outputs.{name}")
        if self.choice is not None:
            total = sum(len(c) for c in self.choice)
            if total > MAX_GRAMMAR_CHARS:
                raise ValueError(
                    f"structured_outputs.choice has {total} characters in all; the limit is "
                    f"{MAX_GRAMMAR_CHARS} characters"
                )
            for choice in self.choice:
                check_text(choice, "a structured_outputs.choice string")


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to sample the completion of one prompt.

    temperature 0 means greedy. top_k 0 or -1 means the whole vocabulary. `seed` makes a
    request reproducible whatever else shares its batch. Frozen: a request holds its params
    from validation to its end, so one object may serve many requests; `clone(**changes)`
    makes a changed copy (validated again).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    # Filled by the engine: EOS ids of the model (not part of the public contract).
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        # The normal forms of what a caller may give loosely (set once, at construction).
        normal = partial(object.__setattr__, self)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stop_token_ids = list(self.stop_token_ids or [])
        normal("stop", stops)
        normal("stop_token_ids", stop_token_ids)
        if isinstance(self.output_kind, str):
            normal("output_kind", RequestOutputKind(self.output_kind))
        if isinstance(self.structured_outputs, dict):
            normal("structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        # Every number that reaches a tensor is checked for its type and range here (an int
        # beyond int64 overflows when the sampler builds its tensors; NaN passes every
        # comparison the wrong way), so a bad value fails at submission, never mid-step.
        _int("n", self.n, 1, MAX_SAMPLES)
        _float("temperature", self.temperature, 0.0, None)
        _check(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_int(self.top_k) and -1 <= self.top_k <= INT64_MAX,
            f"top_k must be -1, 0 (no limit) or a positive integer, got {self.top_k!r}",
        )
        _float("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None:
            _check(
                _is_int(self.max_tokens) and 0 < self.max_tokens <= INT64_MAX,
                f"max_tokens must be a positive integer, got {self.max_tokens!r}",
            )
        _int("min_tokens", self.min_tokens, 0, INT64_MAX)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check(
            _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf,
            f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}",
        )
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, 20)
        for stop in stops:
            _check(isinstance(stop, str) and bool(stop), "stop strings must be non-empty")
            check_text(stop, "a stop string")
        _check(
            all(_is_int(t) and 0 <= t <= INT64_MAX for t in stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        if self.seed is not None:
            _int("seed", self.seed, INT64_MIN, INT64_MAX)
        if self.logit_bias:
            _check(isinstance(self.logit_bias, dict), "logit_bias must be a dict")
            for token, bias in self.logit_bias.items():
                _check(
                    _is_int(token) and 0 <= token <= INT64_MAX,
                    f"logit_bias keys must be token ids (non-negative integers), got {token!r}",
                )
                _float(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments, naming any that are not a sampling parameter."""
        known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int(name: str, value: Any, low: int, high: int) -> None:
    _check(
        _is_int(value) and low <= value <= high,
        f"{name} must be an integer in [{low}, {high}], got {value!r}",
    )


def _float(name: str, value: Any, low: float, high: float | None) -> None:
    """A finite number >= low (and <= high when given)."""
    ok = _is_number(value) and value >= low and (high is None or value <= high)
    where = f"in [{low}, {high}]" if high is not None else f">= {low}"
    _check(ok, f"{name} must be a finite number {where}, got {value!r}")
