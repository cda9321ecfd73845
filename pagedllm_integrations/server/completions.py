"""POST /v1/completions: one engine request per prompt, `n` completions each (with vLLM's
and llama.cpp's extras: structured outputs, truncate_prompt_tokens, add_special_tokens,
priority, request_id, n_predict)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..chat.logprobs import completion_logprobs
from ..chat.outputs import Usage
from ..engine.client import PromptType
from ..engine.engine_request import EngineRequest
from ..engine.request_limits import check_text
from .errors import APIError, sse_error
from .peer_fields import check_fields
from .protocol import MAX_PROMPTS, CompletionRequest
from .requests import check_priority, response_id_of, truncated
from .responses import json_response
from .sampling import build_sampling_params, requested_max_tokens
from .serving import (
    SSE_DONE,
    ClientGone,
    EngineCall,
    ServerState,
    finals_unless_disconnected,
    new_id,
    sse,
)
from .structured import request_constraint


def _prompts(prompt: str | list) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # one prompt given as token ids
    if not prompt:
        raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
    return list(prompt)  # several prompts, each text or token ids


async def create_completion(
    state: ServerState, body: CompletionRequest, request: Request
) -> Response:
    check_fields(body, state.limits.allow_unknown_fields)
    state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix (insertion) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs needs prompt logprobs, which are not supported",
                       param="echo")  # fmt: skip
    prompts = _prompts(body.prompt)
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}",
                       param="prompt")  # fmt: skip
    set_max = "max_tokens" in body.model_fields_set and body.max_tokens is not None
    max_tokens, max_tokens_given = requested_max_tokens(body, body.max_tokens if set_max else None)
    if body.n_predict is None and not set_max:
        max_tokens = body.max_tokens  # OpenAI's default for completions (16)
    check_priority(state, body.priority)
    constraint = request_constraint(body)
    params = build_sampling_params(
        state.engine.model_info,
        body,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        stream=body.stream,
    )
    if constraint is not None:
        params = params.clone(structured_outputs=constraint[1])
    response_id = response_id_of(body, "cmpl")
    engine_id = new_id("cmpl")
    wanted = max_tokens if max_tokens_given else None
    if body.truncate_prompt_tokens is None:  # before any tokenizing: can each one fit?
        for prompt in prompts:
            if isinstance(prompt, str):
                state.prompt_bound.check(len(prompt), wanted, "prompt")
    echoes: list[str] = []

    def engine_prompt(prompt: PromptType) -> PromptType:
        """Tokenized here when the engine's own tokenizing (special tokens added, whole
        prompt kept) is not what the request asks for."""
        add_special = body.add_special_tokens is not False
        if body.truncate_prompt_tokens is None and add_special:
            return prompt
        if isinstance(prompt, str):
            check_text(prompt, "the prompt")
            ids = list(state.engine.tokenizer(prompt, add_special_tokens=add_special).input_ids)
        else:
            ids = list(prompt)  # type: ignore[arg-type]
        return {"prompt_token_ids": truncated(state, ids, body.truncate_prompt_tokens, wanted)}

    def make_requests() -> list[EngineRequest]:
        engine_requests = [
            state.make_request(
                engine_prompt(prompt),
                params,
                f"{engine_id}-{index}" if len(prompts) > 1 else engine_id,
                body.cache_salt,
                max_tokens_given=max_tokens_given,
                priority=body.priority,
                constraint_param=constraint[0] if constraint else "response_format",
            )
            for index, prompt in enumerate(prompts)
        ]
        if body.echo:  # the prompt as the model saw it (truncated, when it was)
            cut = body.truncate_prompt_tokens is not None
            echoes.extend(
                _echo_text(state, list(r.prompt_token_ids) if cut else p)
                for r, p in zip(engine_requests, prompts, strict=True)
            )
        else:
            echoes.extend("" for _ in prompts)
        return engine_requests

    try:
        call = await state.start(request, len(prompts) * params.n, make_requests, user=body.user)
    except ClientGone:
        return Response(status_code=499)
    if body.stream:
        return StreamingResponse(
            _stream(state, body, call, response_id, echoes), media_type="text/event-stream"
        )
    try:
        finals = await finals_unless_disconnected(request, call)
    except ClientGone:
        return Response(status_code=499)

    def build() -> dict[str, Any]:
        choices = []
        for prompt_index, final in enumerate(finals):
            for output in sorted(final.outputs, key=lambda o: o.index):
                choices.append(
                    {
                        "index": prompt_index * body.n + output.index,
                        "text": echoes[prompt_index] + output.text,
                        "logprobs": _logprobs(body, output.token_ids, output.logprobs, 0),
                        "finish_reason": output.finish_reason,
                        "stop_reason": output.stop_reason,
                    }
                )
        return {
            "id": response_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": Usage.of(finals).to_openai(state.limits.report_cached_tokens),
            "system_fingerprint": None,
        }

    return await json_response(build)


def _usage(
    prompt_tokens: list[int], generated: list[list[int]], cached: list[int], report_cached: bool
) -> dict:
    """Usage of a stream over several prompts, from its running counts."""
    usage = Usage(sum(prompt_tokens), sum(map(sum, generated)), sum(cached))
    return usage.to_openai(report_cached)


def _echo_text(state: ServerState, prompt: PromptType) -> str:
    if isinstance(prompt, str):
        return prompt
    return state.engine.tokenizer.decode(prompt)


def _logprobs(body: CompletionRequest, token_ids, entries, offset: int) -> dict[str, Any] | None:
    if body.logprobs is None or entries is None:
        return None
    return completion_logprobs(list(token_ids), list(entries), body.logprobs, offset)


async def _stream(
    state: ServerState,
    body: CompletionRequest,
    call: EngineCall,
    response_id: str,
    echoes: list[str],
) -> AsyncIterator[str]:
    created = int(time.time())
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = include_usage and options is not None and options.continuous_usage_stats
    num_prompts = len(echoes)
    report_cached = state.limits.report_cached_tokens
    prompt_tokens = [0] * num_prompts
    cached = [0] * num_prompts
    generated = [[0] * body.n for _ in range(num_prompts)]
    text_offsets = [[len(echo)] * body.n for echo in echoes]
    echoed: set[tuple[int, int]] = set()
    ended: set[tuple[int, int]] = set()
    try:
        async for prompt_index, out in call:
            prompt_tokens[prompt_index] = len(out.prompt_token_ids)
            cached[prompt_index] = out.num_cached_tokens
            for output in out.outputs:
                key = (prompt_index, output.index)
                generated[prompt_index][output.index] += len(output.token_ids)
                if key in ended:
                    continue
                text = output.text
                if echoes[prompt_index] and key not in echoed:
                    echoed.add(key)
                    text = echoes[prompt_index] + text
                if output.finish_reason is not None:
                    ended.add(key)
                elif not text and not output.token_ids:
                    continue
                offset = text_offsets[prompt_index][output.index]
                text_offsets[prompt_index][output.index] += len(output.text)
                chunk: dict[str, Any] = {
                    "id": response_id,
                    "object": "text_completion",
                    "created": created,
                    "model": state.model_name,
                    "choices": [
                        {
                            "index": prompt_index * body.n + output.index,
                            "text": text,
                            "logprobs": _logprobs(body, output.token_ids, output.logprobs, offset),
                            "finish_reason": output.finish_reason,
                            "stop_reason": output.stop_reason,
                        }
                    ],
                }
                if include_usage:
                    chunk["usage"] = (
                        _usage(prompt_tokens, generated, cached, report_cached)
                        if continuous
                        else None
                    )
                yield sse(chunk)
        if include_usage:
            yield sse(
                {
                    "id": response_id,
                    "object": "text_completion",
                    "created": created,
                    "model": state.model_name,
                    "choices": [],
                    "usage": _usage(prompt_tokens, generated, cached, report_cached),
                }
            )
        yield SSE_DONE
    except Exception as error:  # the 200 is already out: report in the stream
        yield sse_error(error, f"completion stream {response_id}")
        yield SSE_DONE
    finally:
        call.close()
