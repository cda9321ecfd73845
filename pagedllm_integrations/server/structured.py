"""A request's structured-output constraint, in whichever server's spelling it came.

OpenAI's `response_format`, vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` and `structured_outputs`, llama.cpp's `grammar` (GBNF) and `json_schema`:
each becomes the engine's `StructuredOutputsParams`. One answer is decoded under one
constraint, so a request that gives two is a 400 naming the second.
"""

from __future__ import annotations

from typing import Any

from ..engine.sampling_params import StructuredOutputsParams
from .errors import APIError
from .protocol import ResponseFormat

BACKENDS = (None, "auto", "xgrammar")
# structured_outputs keys that carry the constraint, and the settings around it.
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SETTINGS = {
    # True (no free whitespace) is what the JSON grammar does; False allows whitespace
    # without requiring it, so the grammar's output is allowed either way.
    "disable_any_whitespace": lambda v: v is None or isinstance(v, bool),
    "disable_fallback": lambda v: v is None or isinstance(v, bool),  # one backend
    "disable_additional_properties": lambda v: v is None or v is False,
    "whitespace_pattern": lambda v: v is None,
    "structural_tag": lambda v: v is None,
}


def request_constraint(body: Any) -> tuple[str, StructuredOutputsParams] | None:
    """(the field it came from, the constraint), or None; APIError 400 when bad or when
    more than one field gives one."""
    backend = body.guided_decoding_backend
    if backend not in BACKENDS:
        raise APIError(
            400,
            f"guided_decoding_backend {backend!r} is not available; this server has xgrammar",
            param="guided_decoding_backend",
        )
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = response_format_constraint(body.response_format)
    if response_format is not None:
        found.append(("response_format", response_format))
    simple = {
        "guided_json": "json",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
        "grammar": "grammar",
        "json_schema": "json",
    }
    for name, kind in simple.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, _build(name, **{kind: value})))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _from_dict(body.structured_outputs)))
    if len(found) > 1:
        raise APIError(
            400,
            f"{found[0][0]} and {found[1][0]} both constrain the output; give one",
            param=found[1][0],
        )
    return found[0] if found else None


def response_format_constraint(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema (a JSON schema)",
                       param="response_format")  # fmt: skip
    return _build("response_format", json=fmt.json_schema.json_schema)


def _from_dict(spec: dict[str, Any]) -> StructuredOutputsParams:
    for key, value in spec.items():
        if key in _KINDS:
            continue
        allowed = _SETTINGS.get(key)
        if allowed is None:
            raise APIError(400, f"structured_outputs.{key} is not a known setting",
                           param=f"structured_outputs.{key}")  # fmt: skip
        if not allowed(value):
            raise APIError(400, f"structured_outputs.{key}={value!r:.80} is not supported",
                           param=f"structured_outputs.{key}")  # fmt: skip
    kinds = {k: spec[k] for k in _KINDS if spec.get(k) not in (None, False)}
    return _build("structured_outputs", **kinds)


def _build(param: str, **kinds: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kinds)
    except (ValueError, TypeError) as error:  # a schema past the limits, a bad shape
        raise APIError(400, f"{param}: {error}", param=param) from None
