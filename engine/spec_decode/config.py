"""`speculative_config`: vLLM's interface for speculative decoding, "ngram" method only.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    pagedllm serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

As in vLLM: with neither lookup bound given both are 5; with one given the other equals it.
One key is pagedllm's own: max_spec_factor (default 1.0) drafts at most that many tokens
per token of the match, as vLLM's suffix decoding does (spec_decode/ngram.py says why);
null gives vLLM's n-gram rule, always num_speculative_tokens.
Any other key is refused by name (a setting is honoured or refused, never ignored).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "max_spec_factor",
    "model",
)
_DEFAULT_LOOKUP = 5
DEFAULT_MAX_SPEC_FACTOR = 1.0
# More drafted tokens per sequence than this is never useful on one step and lets a typo
# (num_speculative_tokens=400) reserve hundreds of KV slots per sequence.
MAX_SPECULATIVE_TOKENS = 64


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """Prompt-lookup speculation: draft up to `num_speculative_tokens` tokens by matching the
    last n tokens (prompt_lookup_min <= n <= prompt_lookup_max, longest first) of a sequence
    against its earlier tokens, at most max_spec_factor * n of them (None: no such bound),
    and verify them in the next forward pass."""

    num_speculative_tokens: int
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    method: str = "ngram"
    max_spec_factor: float | None = DEFAULT_MAX_SPEC_FACTOR

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported; pagedllm runs "
                f"{', '.join(METHODS)} (prompt lookup, no draft model)"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config {name} must be an integer >= 1, got {value!r}"
                )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        factor = self.max_spec_factor
        if factor is not None and (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not math.isfinite(factor)
            or factor <= 0
        ):
            raise ValueError(
                "speculative_config max_spec_factor must be a number > 0 (draft tokens per "
                f"matched token) or null (always num_speculative_tokens), got {factor!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict, a JSON string (the CLI's form), an instance or
        None (no speculation). ValueError for anything else or any unknown key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from error
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a dict such as "
                '{"method": "ngram", "num_speculative_tokens": 4}, got '
                f"{type(value).__name__}"
            )
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config key(s) {unknown} are not supported; known: "
                f"{sorted(k for k in _KEYS if k != 'model')}"
            )
        settings = dict(value)
        # vLLM's older spelling: model="[ngram]" names the method instead of a draft model.
        model = settings.pop("model", None)
        method = settings.pop("method", None)
        if model is not None:
            if model not in ("ngram", "[ngram]"):
                raise ValueError(
                    f"speculative_config model {model!r}: draft models are not supported, "
                    "only the 'ngram' method (prompt lookup)"
                )
            method = method or "ngram"
        if method == "[ngram]":
            method = "ngram"
        if method is None:
            raise ValueError('speculative_config needs "method": "ngram"')
        if "num_speculative_tokens" not in settings:
            raise ValueError("speculative_config needs num_speculative_tokens (e.g. 4)")
        low = settings.get("prompt_lookup_min")
        high = settings.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = _DEFAULT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        assert low is not None and high is not None  # each branch above sets both
        return cls(
            num_speculative_tokens=settings["num_speculative_tokens"],
            prompt_lookup_max=high,
            prompt_lookup_min=low,
            method=method,
            max_spec_factor=settings.get("max_spec_factor", DEFAULT_MAX_SPEC_FACTOR),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
            "max_spec_factor": self.max_spec_factor,
        }
