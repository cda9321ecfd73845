"""Who sent a request, and how many sequences each client may have in the engine at once.

A client is named by, in this order: the request's `user` field (OpenAI's), the
`X-PagedLLM-User` header, or the address it connects from. The server has one API key,
shared by everyone it lets in, so the key names no client; a proxy in front of the server
that serves several tenants sets `user` or the header per tenant.

Each client may have at most `max_seqs_per_client` sequences (prompts x n) running or waiting
at once. A request larger than that is a 400 that says the limit (it could never be
admitted); a request that would take a client past it while its earlier ones run is a 429
for that client only. Everyone else keeps being admitted: only when all clients together
fill `max_queue_len` does a request get the server-wide 503.

The engine is told each sequence's client (`Request.client_id`) and shares each step's token
budget fairly between clients (engine/client_share.py).
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request

from .errors import APIError

CLIENT_HEADER = "x-pagedllm-user"
MAX_CLIENT_NAME = 64  # longer names (a user field may be anything) are shortened by a hash


def client_identity(request: Request, user: str | None) -> str:
    """The name a request's client is known by (in admission counts and metrics)."""
    if user:
        return "user:" + _bounded(user)
    header = request.headers.get(CLIENT_HEADER)
    if header:
        return "user:" + _bounded(header)
    host = request.client.host if request.client is not None else "unknown"
    return "addr:" + host


def _bounded(name: str) -> str:
    if len(name) <= MAX_CLIENT_NAME and name.isprintable():
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{name[:32].encode('ascii', 'replace').decode()}~{digest}"


class ClientAdmission:
    """Sequences in flight per client (the event loop's thread only)."""

    def __init__(self, max_seqs_per_client: int | None) -> None:
        if max_seqs_per_client is not None and max_seqs_per_client < 1:
            raise ValueError(
                f"max_seqs_per_client must be >= 1 (or None for no limit), got "
                f"{max_seqs_per_client}"
            )
        self.limit = max_seqs_per_client
        self.in_flight: dict[str, int] = {}

    def check(self, client: str, sequences: int) -> None:
        """APIError (400 or 429) when `client` may not add `sequences` now."""
        limit = self.limit
        if limit is None:
            return
        if sequences > limit:
            raise APIError(
                400,
                f"this request needs {sequences} sequences (prompts x n) but a client may "
                f"have at most {limit} running or waiting at once; split it into requests "
                f"of at most {limit}",
                param="n",
                code="client_limit_exceeded",
            )
        held = self.in_flight.get(client, 0)
        if held + sequences > limit:
            raise APIError(
                429,
                f"you have {held} sequences running or waiting and a client may have at most "
                f"{limit} at once; this request needs {sequences}: retry when some end",
                code="client_queue_full",
                type="rate_limit_error",
            )

    def admit(self, client: str, sequences: int) -> None:
        self.in_flight[client] = self.in_flight.get(client, 0) + sequences

    def release(self, client: str, sequences: int) -> None:
        left = self.in_flight.get(client, 0) - sequences
        if left > 0:
            self.in_flight[client] = left
        else:  # forget idle clients: the table holds only those with work in flight
            self.in_flight.pop(client, None)
