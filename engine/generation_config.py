"""The model authors' sampling defaults, from the folder's generation_config.json.

As vLLM's `--generation-config auto` (its default): temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (as max_tokens) become the defaults of every request
that does not set them itself. Only values that differ from transformers' own defaults
count (vLLM reads `GenerationConfig.to_diff_dict()`), so a file that merely restates them
changes nothing. `do_sample` is not read, as in vLLM.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> (SamplingParams field, transformers' default).
_SAMPLING_KEYS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def read_generation_config(folder: Path) -> dict[str, Any]:
    """The raw generation_config.json of a model folder ({} when there is none)."""
    path = Path(folder) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        loaded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    return loaded if isinstance(loaded, dict) else {}


def generation_defaults(generation_config: dict[str, Any], source: str = "") -> dict[str, Any]:
    """SamplingParams defaults from a generation config; ValueError if one is invalid."""
    defaults = {}
    for key, (name, hf_default) in _SAMPLING_KEYS.items():
        value = generation_config.get(key)
        if value is not None and value != hf_default:
            defaults[name] = value
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"the generation_config.json of {source} holds a bad value: {error}"
        ) from error
    if defaults:
        logger.info(
            "sampling defaults from %s's generation_config.json: %s (explicit settings win)",
            source,
            defaults,
        )
    return defaults
