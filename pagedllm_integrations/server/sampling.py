"""OpenAI request fields -> `SamplingParams` and structured-output constraints."""

from __future__ import annotations

from ..chat.sampling import build_sampling_params as build_params
from ..engine.client import ModelInfo
from ..engine.sampling_params import RequestOutputKind, SamplingParams
from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest


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
        "repetition_penalty": _one_of(body, "repetition_penalty", "repeat_penalty"),
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
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        # Streams carry only what is new; a plain response needs only the end.
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        logit_bias=_logit_bias(body.logit_bias, model.vocab_size),
    )


def _one_of(body: CompletionRequest | ChatCompletionRequest, name: str, alias: str):
    """A value given under its own name or under another server's; both must agree."""
    value, other = getattr(body, name), getattr(body, alias)
    if value is not None and other is not None and value != other:
        raise APIError(400, f"{name}={value} and {alias}={other} disagree; give one",
                       param=alias)  # fmt: skip
    return value if value is not None else other


def requested_max_tokens(body: CompletionRequest | ChatCompletionRequest, given: int | None):
    """max_tokens as given (OpenAI's max_tokens / max_completion_tokens), or llama.cpp's
    n_predict (-1: no limit); (value, whether the client set one)."""
    if body.n_predict is None:
        return given, given is not None
    if given is not None:
        raise APIError(400, "give max_tokens or n_predict, not both", param="n_predict")
    if body.n_predict == 0:
        raise APIError(400, "n_predict 0 (evaluate the prompt only) is not supported; give a "
                       "positive n_predict, or -1 for no limit", param="n_predict")  # fmt: skip
    return (None, False) if body.n_predict == -1 else (body.n_predict, True)


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
