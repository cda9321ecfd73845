"""Per-request sampling settings, shaped like vLLM's `SamplingParams`.

Everything a caller can get wrong is checked in `__post_init__`, so a bad value is a
`ValueError` at submission time and never reaches the engine thread.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class RequestOutputKind(enum.Enum):
    """What each streamed `RequestOutput` carries."""

    CUMULATIVE = "cumulative"  # all text and tokens so far
    DELTA = "delta"  # only what is new since the previous output
    FINAL_ONLY = "final_only"  # one output, when the request ends


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on the generated text (exactly one field set).

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

            self.json = schema_dict(self.json)
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completion of one prompt.

    temperature 0 means greedy. top_k 0 or -1 means the whole vocabulary. `seed` makes a
    request reproducible whatever else shares its batch.
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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.output_kind, str):
            self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(
            isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"
        )
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            f"top_k must be -1, 0 (no limit) or a positive integer, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens > 0),
            f"max_tokens must be a positive integer, got {self.max_tokens!r}",
        )
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        if self.seed is not None:
            _check(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")

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
