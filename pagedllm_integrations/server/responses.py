"""Plain (non-streamed) JSON responses built and encoded off the event loop.

A response of n=128 choices x 256 tokens x 20 top logprobs is 47 MiB of JSON: building its
dicts and encoding them took seconds, and on the event loop that stopped every other
client, /health included. Here both run on a worker thread, and the encoding goes one choice
at a time: json.dumps holds the GIL for the whole of one call, so one call per choice
lets the event loop run between them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

# As Starlette's JSONResponse: compact, UTF-8, no NaN (not JSON).
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def encode_json(payload: dict[str, Any]) -> bytes:
    """`payload` as JSON (UTF-8); a top-level "choices" list is encoded item by item."""
    encode = _ENCODER.encode
    pieces = []
    for key, value in payload.items():
        if key == "choices" and isinstance(value, list):
            text = "[" + ",".join(encode(item) for item in value) + "]"
        else:
            text = encode(value)
        pieces.append(encode(key) + ":" + text)
    return ("{" + ",".join(pieces) + "}").encode("utf-8")


async def json_response(build: Callable[[], dict[str, Any]], status_code: int = 200) -> Response:
    """Call `build` and encode what it returns on a worker thread; the response to send."""

    def render() -> bytes:
        return encode_json(build())

    body = await asyncio.to_thread(render)
    return Response(body, status_code=status_code, media_type="application/json")
