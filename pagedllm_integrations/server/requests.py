"""vLLM's request fields both routes share: priority, request_id, truncate_prompt_tokens."""

from __future__ import annotations

import re
from typing import Any

from .errors import APIError
from .serving import ServerState, new_id

# A client's request id goes into the response id and the logs: plain characters only.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]+")


def check_priority(state: ServerState, priority: int) -> None:
    """A priority other than 0 needs the engine's priority scheduling (as in vLLM)."""
    policy = getattr(getattr(state.engine, "config", None), "scheduling_policy", "fcfs")
    name = policy if isinstance(policy, str) else getattr(policy, "name", "")
    if priority != 0 and name != "priority":
        raise APIError(
            400,
            f"priority {priority} needs priority scheduling; this server schedules "
            f"{name or 'first come, first served'} (start it with --scheduling-policy priority)",
            param="priority",
        )


def response_id_of(body: Any, prefix: str) -> str:
    """The response's id: the client's request_id under the route's prefix (vLLM's way),
    else a fresh one. The engine's own request ids stay unique either way."""
    request_id = body.request_id
    if request_id is None:
        return new_id(prefix)
    if not _REQUEST_ID.fullmatch(request_id):
        raise APIError(400, "request_id may hold only letters, digits and . _ : -",
                       param="request_id")  # fmt: skip
    return f"{prefix}-{request_id}"


def truncated(
    state: ServerState, token_ids: list[int], keep: int | None, wanted: int | None
) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` prompt tokens; -1 keeps as many as fit
    with the tokens asked for (max_tokens, else one)."""
    if keep is None:
        return token_ids
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be -1 (as many as fit) or >= 1",
                       param="truncate_prompt_tokens")  # fmt: skip
    if keep == -1:
        keep = max(state.engine.max_model_len - (wanted or 1), 1)
    return token_ids[-keep:] if len(token_ids) > keep else token_ids
