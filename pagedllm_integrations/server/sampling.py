"""OpenAI request fields -> `SamplingParams`, and engine logprobs -> OpenAI's logprob shapes."""

from __future__ import annotations

from typing import Any

from ..engine.outputs import Logprob
from ..engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat


def build_sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    stream: bool,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Raises ValueError (a 400) for any value the engine would refuse."""
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, f"max_tokens must be a positive integer, got {max_tokens}",
                       param="max_tokens", code="invalid_value")  # fmt: skip
    return SamplingParams(
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        # Streams carry only what is new; a plain response needs only the end.
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured,
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
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
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def _ranked(entry: dict[int, Logprob], top: int) -> list[tuple[int, Logprob]]:
    """The `top` most likely tokens of one position, most likely first."""
    return sorted(entry.items(), key=lambda item: item[1].rank)[:top]


def _text(logprob: Logprob | None, token_id: int) -> str:
    if logprob is None or logprob.decoded_token is None:
        return f"<token {token_id}>"
    return logprob.decoded_token


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], top: int, text_offset: int
) -> dict[str, Any]:
    """Legacy completions shape: parallel lists, text offsets counted from `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        text = _text(chosen, token_id)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        top_logprobs.append(
            {_text(lp, tid): lp.logprob for tid, lp in _ranked(entry, top)} if top else None
        )
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], top: int
) -> list[dict[str, Any]]:
    """Chat shape: the `content` list of {token, logprob, bytes, top_logprobs}."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        text = _text(chosen, token_id)
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob if chosen is not None else -9999.0,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": _text(lp, tid),
                        "logprob": lp.logprob,
                        "bytes": list(_text(lp, tid).encode("utf-8")),
                    }
                    for tid, lp in _ranked(entry, top)
                ],
            }
        )
    return content


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
