"""POST /v1/embeddings in OpenAI's schema, over the engine that serves embeddings: a second
engine beside the chat model (`pagedllm serve --embedding-model ...`), or the served model
itself when it embeds (an encoder served alone, or a decoder with last-token pooling).

    {"input": "text" | ["text", ...] | [token ids] | [[token ids], ...],
     "model": name, "encoding_format": "float" | "base64", "dimensions": d,
     "truncate": false}                                   # pagedllm's extra (see README)
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
        "model": name, "usage": {"prompt_tokens": n, "total_tokens": n}}

Inputs are tokenized and validated off the event loop (a request of a few short texts, on
it: cheaper than the hop), all before any is submitted; every bad input is a 400 naming its
index. base64 is the float32 little-endian bytes of each vector, as OpenAI's clients
decode it.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from fastapi.responses import Response
from pydantic import Field
from starlette.requests import Request

from ..engine.client import EngineClient
from ..engine.pooling import PoolingParams
from .errors import APIError
from .protocol import _Body
from .serving import _DISCONNECT_POLL_S, ClientGone, ServerState

MAX_INPUTS = 2048  # OpenAI's limit on the items of one request

_INPUT_SHAPES = (
    "input must be a string, a list of strings, a list of token ids or a list of lists of token ids"
)


class EmbeddingRequest(_Body):
    input: Any  # checked by _prompts, which names what is wrong
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # pagedllm's extra: embed the first max_model_len tokens of a longer input.
    truncate: bool = False


@dataclass(slots=True)
class EmbeddingRoute:
    """The engine behind /v1/embeddings and the names clients may call it by."""

    engine: EngineClient
    model_name: str
    state: ServerState  # the app's: its prepare pool and admission count

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.engine.model_name):
            raise APIError(
                404,
                f"the model {model!r} does not exist here; /v1/embeddings serves "
                f"{self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )


def embedding_route(
    state: ServerState,
    engine: EngineClient,
    embedding_engine: EngineClient | None,
    embedding_model_name: str | None,
) -> EmbeddingRoute | None:
    """What serves /v1/embeddings: the embedding engine, else the app's own engine if it
    is an embedding model; None when neither."""
    if embedding_engine is not None:
        name = embedding_model_name or embedding_engine.model_name
        return EmbeddingRoute(embedding_engine, name, state)
    # The served model itself only when it is an embedding model (an encoder, or
    # runner='pooling'): a chat model's last-token vectors are not asked for by default.
    if engine.model_info.tasks == ("embed",):
        return EmbeddingRoute(engine, state.model_name, state)
    return None


def _prompts(value: Any) -> list[Any]:
    """The inputs of a request as engine prompts (a text, or a list of token ids)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise APIError(400, f"{_INPUT_SHAPES}, not {type(value).__name__}", param="input")
    if value and all(_is_token(t) for t in value):
        return [value]  # one input given as token ids
    for index, item in enumerate(value):
        if not (isinstance(item, str) or (isinstance(item, list) and all(map(_is_token, item)))):
            raise APIError(
                400, f"input[{index}] is a {type(item).__name__}: {_INPUT_SHAPES}", param="input"
            )
    return value


# Up to this many characters of text (or token ids) a request is tokenized on the event
# loop: a query of a few words takes ~50 us there, the pool's round trip ~0.2 ms.
_INLINE_CHARACTERS = 1024


def _small(prompts: list[Any]) -> bool:
    return sum(len(p) for p in prompts) <= _INLINE_CHARACTERS


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def create_embedding(
    route: EmbeddingRoute, body: EmbeddingRequest, request: Request
) -> Response:
    route.check_model(body.model)
    prompts = _prompts(body.input)
    if not prompts:
        raise APIError(400, "input is empty: give a string or a list of inputs", param="input")
    if len(prompts) > MAX_INPUTS:
        raise APIError(
            400,
            f"input has {len(prompts)} items; at most {MAX_INPUTS} per request: split it",
            param="input",
        )
    try:
        params = PoolingParams(dimensions=body.dimensions, truncate=body.truncate)
    except ValueError as error:
        raise APIError(400, str(error), param="dimensions") from None
    state, engine = route.state, route.engine
    limit = state.max_queue_len
    # One request larger than the limit is admitted when nothing else waits (embedding
    # inputs are prompt passes, cheap next to generation; MAX_INPUTS bounds them).
    if limit is not None and state.in_flight + len(prompts) > max(limit, len(prompts)):
        raise APIError(
            503,
            f"the server is busy ({state.in_flight} sequences running or waiting, limit "
            f"{limit}); retry later",
            code="queue_full",
        )
    state.in_flight += len(prompts)  # reserved now: the awaits below let others in
    try:
        try:
            if _small(prompts):  # tokenizing costs less than the hop to the pool
                engine_requests = engine.process_embedding_inputs(prompts, params)
            else:
                engine_requests = await state.off_loop(
                    request, lambda: engine.process_embedding_inputs(prompts, params)
                )
        except ValueError as error:
            raise APIError(400, str(error), param="input") from None
        outputs = await _results(engine, engine_requests, request)
    except ClientGone:
        return Response(status_code=499)
    finally:
        state.in_flight -= len(prompts)
    data = [
        {"object": "embedding", "index": index, "embedding": _encode(output, body.encoding_format)}
        for index, output in enumerate(outputs)
    ]
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    body_bytes = orjson.dumps(
        {
            "object": "list",
            "data": data,
            "model": route.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
    return Response(body_bytes, media_type="application/json")


async def _results(engine: EngineClient, engine_requests: list, request: Request) -> list[Any]:
    """The finished outputs, in order; aborts them all if the client leaves first."""
    loop = asyncio.get_running_loop()
    streams = engine.submit_many(engine_requests, loop=loop)

    async def final(stream: Any) -> Any:
        last = None
        async for output in stream:
            last = output
        if last is None or last.outputs is None:
            raise APIError(500, "an embedding request ended without a vector")
        return last

    task = asyncio.ensure_future(asyncio.gather(*(final(s) for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return list(task.result())
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
        for stream in streams:
            if not stream.finished:
                engine.abort(stream.request_id)


def _encode(output: Any, encoding_format: str) -> np.ndarray | str:
    """The vector as float32: base64 of its little-endian bytes, or the array itself, which
    orjson writes as JSON numbers, each the shortest text that reads back as the same
    float32 (json.dumps of its float64 values took 0.4 ms for 384 of them, as long as the
    rest of a short query's route)."""
    vector = np.ascontiguousarray(output.outputs.data.float().numpy(), dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode()
    return vector
