"""Sampling settings from layers: the model's generation defaults, then the wrapper's
settings, then the call's. None means "not set" in every layer. max_tokens not set at all
means until the end of the answer or of the context (never SamplingParams' vLLM default of
16, which cut answers, forced tool calls and structured outputs mid-way)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(
    name for name in SamplingParams.__dataclass_fields__ if not name.startswith("_")
)


def merge_sampling(defaults: Mapping[str, Any], *layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win; None values are skipped; max_tokens defaults to no limit."""
    values: dict[str, Any] = {"max_tokens": None, **defaults}
    for layer in layers:
        values.update({k: v for k, v in layer.items() if v is not None})
    return values


def build_sampling_params(
    defaults: Mapping[str, Any], *layers: Mapping[str, Any], **fixed: Any
) -> SamplingParams:
    """SamplingParams from the layers (see `merge_sampling`) and `fixed` values set as given
    (None included); ValueError naming any field SamplingParams does not have."""
    values = merge_sampling(defaults, *layers)
    values.update(fixed)
    return SamplingParams.from_kwargs(**values)


def merge_stops(*stops: Sequence[str] | str | None) -> list[str]:
    """Stop strings of every layer all apply (first occurrence order, no repeats)."""
    merged: list[str] = []
    for stop in stops:
        if stop is None:
            continue
        for s in [stop] if isinstance(stop, str) else stop:
            if s and s not in merged:
                merged.append(s)
    return merged
