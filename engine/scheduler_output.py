"""What one scheduler step decides (`SchedulerOutput`: the requests it runs and how many of
their tokens) and what committing it changed (`StepUpdate`). Re-exported by scheduler.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it in this step (its draft tokens included)
    start: int  # its num_computed_tokens before this step (position of the first one)
    # Speculative tokens after its last known token, verified by this step (the last
    # len(draft_token_ids) of its num_tokens).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def completes_prompt(self) -> bool:
        """True when this step computes its last known token, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens + len(self.draft_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # (block ids on device, slots in the host swap space) to copy before the forward pass.
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)
    # Disk swap slots of requests expected to resume soon: read them ahead (a hint).
    swap_ahead: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # draft tokens among num_batched_tokens
    num_pooling: int = 0  # embedding requests among scheduled (they sample no token)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepUpdate:
    """What committing a step changed."""

    changed: list[Request] = field(default_factory=list)  # got tokens (or failed) this step
    failed: list[tuple[Request, str]] = field(default_factory=list)  # (request, why)


__all__ = ["ScheduledRequest", "SchedulerOutput", "StepUpdate"]
