"""OpenAI request fields -> `SamplingParams` and structured-output constraints."""

from __future__ import annotations

from ..chat.sampling import build_sampling_params as build_params
from ..engine.client import ModelInfo
from ..engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat


def build_sampling_params(
    model: ModelInfo,
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    stream: bool,
) -> SamplingParams:
    """Fields the request leaves out take the model's generation defaults (as vLLM's
    server does), else vLLM's neutral values. Raises a 400 for any value the engine
    would refuse."""
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, f"max_tokens must be a positive integer, got {max_tokens}",
                       param="max_tokens", code="invalid_value")  # fmt: skip
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "max_tokens": max_tokens,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
    }
    try:
        return _build(model, body, given, logprobs, stream)
    except ValueError as error:  # name the field: the engine's messages start with it
        first = str(error).split(" ", 1)[0].split("[", 1)[0]
        param = first if first in type(body).model_fields else None
        raise APIError(400, str(error), param=param, code="invalid_value") from None


def _build(
    model: ModelInfo,
    body: CompletionRequest | ChatCompletionRequest,
    given: dict,
    logprobs: int | None,
    stream: bool,
) -> SamplingParams:
    return build_params(
        model.generation_defaults,
        given,
        n=body.n,
        seed=body.seed,
        min_tokens=body.min_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        # Streams carry only what is new; a plain response needs only the end.
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        logit_bias=_logit_bias(body.logit_bias, model.vocab_size),
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}",
                           param="logit_bias") from None  # fmt: skip
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias token id {token} is outside the vocabulary "
                           f"(0..{vocab_size - 1})", param="logit_bias")  # fmt: skip
        parsed[token] = float(value)
    return parsed


def response_format_constraint(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema (a JSON schema)",
                       param="response_format")  # fmt: skip
    try:
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)
    except ValueError as error:  # a schema past the limits (engine/request_limits.py)
        raise APIError(400, str(error), param="response_format") from None
