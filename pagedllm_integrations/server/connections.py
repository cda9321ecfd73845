"""Connection hygiene below the ASGI app: timeouts for a request's head, a cap on open
connections (per client address and in all), and the raw answers sent when one is refused.

Why a protocol subclass: uvicorn arms no timer until a response has been sent, so a
connection that sends nothing, or half a request head, stays open for ever; and the app
never sees a connection until its head is complete. Both limits must live where the
connection does. The body timeout and the body size limit, which need the request's
headers, live in the ASGI guard (guard.py).

    header_timeout    a request head must be complete within this many seconds of the
                      connection opening (or of the previous response ending)
    keep_alive        an idle connection between requests is closed after this (uvicorn's)
    max_connections   open connections in all; past it a new one is answered 503 and closed
    max_per_client    open connections from one client address; past it 429 and closed

The caps keep the server's file descriptors from running out: a descriptor limit of 256
and 300 half-sent requests from one address no longer stop /health and chat for others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .defaults import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_S
from .errors import error_body

logger = logging.getLogger(__name__)

# Descriptors kept for everything that is not a client connection (model files, logs, the
# engine's pipes, the connections being answered with a refusal).
_RESERVED_FDS = 64
_PER_CLIENT_CEILING = 256
# A refused connection is answered, half-closed and read (and dropped) for a moment before it
# closes: closing a socket with unread bytes resets it, and the client may lose the answer.
# Only so many linger at once; past that a refused connection closes at once.
_LINGER_S = 2.0
_MAX_LINGERING = 32


def descriptor_limit() -> int:
    """This process's soft limit on open file descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections(fd_limit: int | None = None) -> int:
    """Open connections the server keeps at most: its descriptor limit less a reserve."""
    limit = descriptor_limit() if fd_limit is None else fd_limit
    return max(limit - _RESERVED_FDS, limit // 2, 1)


def default_max_per_client(max_connections: int) -> int:
    """Half the connections, at most 256: one address never holds them all."""
    return max(min(_PER_CLIENT_CEILING, max_connections // 2), 1)


@dataclass(slots=True, frozen=True)
class ConnectionLimits:
    """Timeouts and caps for the server's connections (None: the default for this process,
    from its descriptor limit; 0 for a cap: no cap)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_S
    max_connections: int | None = None
    max_connections_per_client: int | None = None

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        for name in ("max_connections", "max_connections_per_client"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 (0: no cap), got {value!r}")

    def resolved(self) -> tuple[int | None, int | None]:
        """(max connections, max per client) with defaults filled in; None means no cap."""
        total = self.max_connections
        if total is None:
            total = default_max_connections()
        per_client = self.max_connections_per_client
        if per_client is None:
            per_client = default_max_per_client(total) if total else _PER_CLIENT_CEILING
        return total or None, per_client or None


class ConnectionCounter:
    """Open connections, in all and per client address (event loop thread only)."""

    def __init__(self, limits: ConnectionLimits):
        self.max_total, self.max_per_client = limits.resolved()
        self.total = 0
        self.per_client: Counter[str] = Counter()
        self.refused = 0
        self.lingering = 0

    def admit(self, host: str | None) -> tuple[int, str, str] | None:
        """Count a new connection in, or say why not: (status, message, code)."""
        if self.max_total is not None and self.total >= self.max_total:
            return (
                503,
                f"the server has {self.total} connections open, its limit; retry later",
                "too_many_connections",
            )
        key = host or "?"
        if self.max_per_client is not None and self.per_client[key] >= self.max_per_client:
            return (
                429,
                f"this address has {self.per_client[key]} connections open, the limit per "
                "client; reuse a connection or close some",
                "too_many_connections",
            )
        self.total += 1
        self.per_client[key] += 1
        return None

    def release(self, host: str | None) -> None:
        key = host or "?"
        self.total -= 1
        self.per_client[key] -= 1
        if self.per_client[key] <= 0:
            del self.per_client[key]


def raw_response(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with OpenAI's error body that closes the connection,
    for the moments no request has been parsed (h11 cannot answer before one)."""
    reasons = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}
    kind = {408: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    payload = json.dumps(error_body(message, kind, None, code)).encode()
    head = (
        f"HTTP/1.1 {status} {reasons.get(status, 'Error')}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + payload


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """An h11 protocol class bound to `limits` and to one counter of this server's
    connections (what uvicorn's `Config(http=...)` takes)."""
    counter = ConnectionCounter(limits)
    header_timeout = limits.header_timeout

    class GuardedH11Protocol(H11Protocol):
        connection_counter = counter

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._admitted = False
            self._lingering = False
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_bytes = 0  # bytes of the request head received so far

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            refusal = counter.admit(host)
            if refusal is not None:
                counter.refused += 1
                logger.info("refused a connection from %s: %s", host, refusal[1])
                transport.write(raw_response(*refusal))
                self._close_lingering()
                return
            self._admitted = True
            self._arm_head_timer()

        def _close_lingering(self) -> None:
            """Half-close after the answer and drop what arrives for a moment, then close."""
            transport = self.transport
            if counter.lingering >= _MAX_LINGERING or not transport.can_write_eof():
                transport.close()
                return
            counter.lingering += 1
            self._lingering = True
            transport.write_eof()
            self._head_timer = self.loop.call_later(_LINGER_S, transport.close)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._lingering:
                self._lingering = False
                counter.lingering -= 1
            self._cancel_head_timer()
            if self._admitted:
                self._admitted = False
                counter.release(self.client[0] if self.client else None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # a refused connection: its request is not read
            waiting_for_head = self.conn.their_state is h11.IDLE
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a whole head arrived
                self._cancel_head_timer()
                self._head_bytes = 0
            elif waiting_for_head:
                self._head_bytes += len(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Waiting for the next request's head (unless a pipelined one is already in).
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self._head_bytes:  # half a request: say why it is dropped
                self.transport.write(
                    raw_response(
                        408,
                        f"the request head did not arrive within {header_timeout:g} s",
                        "header_timeout",
                    )
                )
            self._admitted = False
            counter.release(self.client[0] if self.client else None)
            self._close_lingering()

    return GuardedH11Protocol
