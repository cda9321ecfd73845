"""ASGI middleware in front of every route: API key (401), body size (413), body timeout
(408).

It is plain ASGI rather than a Starlette BaseHTTPMiddleware because it must replay the body
it has read, and pass the client's disconnect through untouched: streaming responses cancel
themselves (and abort their engine requests) when that disconnect arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .defaults import DEFAULT_BODY_TIMEOUT_S
from .errors import error_body

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health",)  # reachable without the API key (load balancers' probes)
_CLOSE = (b"connection", b"close")
_LINGER_S = 5.0  # how long a refused body is read (and dropped) before the connection closes


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    ):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    def _authorized(self, given: bytes) -> bool:
        """`Bearer <key>`; the scheme is case-insensitive (RFC 9110), the key is not."""
        assert self.expected is not None
        scheme, _, token = given.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope.get("path") not in _OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not self._authorized(given):
                reason = (
                    "missing API key: send 'Authorization: Bearer <key>'"
                    if not given
                    else "invalid API key"
                )
                await _reply(send, 401, reason, "authentication_error", "invalid_api_key",
                             extra_headers=[(b"www-authenticate", b"Bearer")])  # fmt: skip
                return
        too_large = (
            f"the request body is larger than {self.max_body_bytes} bytes; send a smaller one"
        )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            # Answered before reading a byte of it: a client that declares 4 GiB and sends
            # nothing gets its 413 at once (the body is then drained for a while, boundedly).
            await self._refuse(receive, send, 413, too_large, "body_too_large")
            return
        parts: list[bytes] = []
        size, more, disconnected = 0, True, False
        try:
            async with asyncio.timeout(self.body_timeout):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        disconnected = True
                        break
                    parts.append(message.get("body", b""))
                    size += len(parts[-1])
                    more = message.get("more_body", False)
                    if size > self.max_body_bytes:
                        break
        except TimeoutError:
            logger.info("a request body did not arrive within %gs", self.body_timeout)
            slow = f"the request body did not arrive within {self.body_timeout:g} s"
            await _reply(send, 408, slow, "invalid_request_error", "body_timeout",
                         extra_headers=[_CLOSE])  # fmt: skip
            return
        if size > self.max_body_bytes:
            await self._refuse(receive, send, 413, too_large, "body_too_large", more)
            return
        if disconnected:
            return
        body = b"".join(parts)
        problem = text_problem(body)
        if problem is not None:
            logger.info("refused a request body: %s", problem)
            await _reply(send, 400, problem, "invalid_request_error", "invalid_text")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect

        await self.app(scope, replay, send)

    async def _refuse(
        self, receive: Receive, send: Send, status: int, message: str, code: str,
        more: bool = True,
    ) -> None:  # fmt: skip
        """Answer now and close the connection; meanwhile read (and drop) what the client
        still sends, for a bounded time and size, so a client that sends its whole body
        before it reads gets to read the error rather than a reset connection."""
        payload = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            _CLOSE,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        # The whole error goes out now; the end of the response (and the close) waits.
        await send({"type": "http.response.body", "body": payload, "more_body": True})
        if more:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self.body_timeout, _LINGER_S)):
                    await _drain(receive, limit=4 * self.max_body_bytes)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# A \\uXXXX escape of a UTF-16 surrogate (either half) in JSON text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def text_problem(body: bytes) -> str | None:
    """Why a body's text cannot reach the tokenizer (or a JSON response), or None.

    Bytes that are not UTF-8, and JSON escapes of lone UTF-16 surrogates ("\\ud800" without
    its low half): Python keeps such a string, and it fails later, deep in the tokenizer or
    in encoding the response. A surrogate pair (an emoji, as json.dumps writes it) is fine.
    All in C: a scan for surrogate escapes, and only when there are some, the body parsed
    and written back as UTF-8, which fails exactly on a lone surrogate (a key's or a value's).
    """
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"the request body is not valid UTF-8 (byte {error.start})"
    if _SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(error.object[error.start])
        return (
            f"the request body holds a lone UTF-16 surrogate (U+{code:04X}); every string must "
            "be valid Unicode"
        )
    except (ValueError, RecursionError):  # not JSON: the route answers 400 for that
        return None
    return None


async def _drain(receive: Receive, limit: int) -> None:
    """Read (and drop) the rest of a rejected body, so the client, still sending, gets to
    read the error instead of a reset connection. Stops after `limit` bytes."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _reply(
    send: Send,
    status: int,
    message: str,
    type_: str,
    code: str,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    payload = json.dumps(error_body(message, type_, None, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
