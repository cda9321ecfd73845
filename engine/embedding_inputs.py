"""Embedding requests in: tokenize, validate and make the frozen `EngineRequest` (any
thread), as `InputProcessor.process_inputs` does for generation requests.

Truncation: a prompt longer than the model's limit (max_model_len) is a ValueError unless
the request says `truncate=True`. sentence-transformers cuts silently; here a caller who
embeds a long document learns that its end would be left out of the vector, and opts in.
Truncated text keeps its first tokens and the tokenizer's closing special token (what
sentence-transformers and the tokenizer's own `truncation=True` give); truncated token ids
keep their first `max_model_len`.
"""

from __future__ import annotations

from typing import Any

from .engine_request import EngineRequest
from .model_info import ModelInfo, PromptType, check_in_vocabulary, prompt_text_or_ids
from .pooling import PoolingParams, check_dimensions
from .request_limits import check_text


def make_embedding_request(
    tokenizer: Any,
    info: ModelInfo,
    prompt: PromptType,
    params: PoolingParams | None,
    request_id: str | None,
    priority: int,
    token_ids: list[int] | None = None,
) -> EngineRequest:
    """One validated embedding request; ValueError saying what is wrong when it is bad.
    `token_ids`: a text prompt's tokens, when they were made already."""
    if "embed" not in info.tasks:
        raise ValueError(
            f"{info.name} does not serve embeddings here (runner 'generate', or tensor "
            "parallelism): load it with runner='pooling' or 'auto' and tensor_parallel_size=1"
        )
    params = params if params is not None else PoolingParams()
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling params must be a PoolingParams, got {type(params).__name__}")
    pooler = info.pooler
    check_dimensions(params, pooler, info.embedding_size, info.name)
    text, token_ids = _tokenize(tokenizer, info, prompt, params.truncate, token_ids)
    check_in_vocabulary(token_ids, info.vocab_size)
    return EngineRequest.new(text, token_ids, params, request_id, priority=priority)


def make_embedding_requests(
    tokenizer: Any,
    info: ModelInfo,
    prompts: list[PromptType],
    params: PoolingParams | None,
    priority: int = 0,
) -> list[EngineRequest]:
    """Many embedding requests at once; the texts among them are tokenized in one call (the
    tokenizer's batch encoding is several times faster than one call per text). A bad
    input is a ValueError naming its index; nothing is made unless every input is good."""
    if params is not None and not isinstance(params, PoolingParams):
        raise ValueError(f"pooling params must be a PoolingParams, got {type(params).__name__}")
    texts = [p for p in prompts if isinstance(p, str) and p]
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str) and prompt:
            try:
                check_text(prompt, "the input")
            except ValueError as error:
                raise ValueError(f"input {index}: {error}") from None
    encoded: dict[str, list[int]] = {}
    if texts:
        truncate = params is not None and params.truncate
        kwargs = dict(truncation=True, max_length=info.max_model_len) if truncate else {}
        encoded = dict(zip(texts, tokenizer(texts, **kwargs).input_ids))
    requests = []
    for index, prompt in enumerate(prompts):
        try:
            given = encoded.get(prompt) if isinstance(prompt, str) else None
            requests.append(
                make_embedding_request(
                    tokenizer, info, prompt, params, None, priority, token_ids=given
                )
            )
        except ValueError as error:
            raise ValueError(f"input {index}: {error}") from None
    return requests


def _tokenize(
    tokenizer: Any,
    info: ModelInfo,
    prompt: PromptType,
    truncate: bool,
    token_ids: list[int] | None = None,
) -> tuple[str | None, list[int]]:
    limit = info.max_model_len
    if isinstance(prompt, str) and prompt and token_ids is not None:  # tokenized in a batch
        _check_length(len(token_ids), limit)
        return prompt, list(token_ids)
    prompt = prompt_text_or_ids(prompt, "input")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the input is an empty string: give some text to embed")
        check_text(prompt, "the input")
        if truncate:
            ids = tokenizer(prompt, truncation=True, max_length=limit).input_ids
        else:
            ids = tokenizer(prompt).input_ids
        _check_length(len(ids), limit)
        return prompt, list(ids)
    if not prompt:
        raise ValueError("the input is an empty list of token ids: give at least one")
    ids = prompt[:limit] if truncate else prompt
    _check_length(len(ids), limit)
    return None, ids


def _check_length(num_tokens: int, limit: int) -> None:
    if num_tokens == 0:
        raise ValueError("the input gives no tokens: give some text to embed")
    if num_tokens > limit:
        raise ValueError(
            f"the input has {num_tokens} tokens but the model takes at most {limit} "
            "(max_model_len); shorten it, split it, or pass truncate=True to embed only its "
            f"first {limit} tokens"
        )
