"""Scheduling policies: the order in which the scheduler serves requests.

`fcfs` and `priority` as in vLLM; `short_first` (engine/short_first.py) serves the request with
the least work left first, aged so that every wait is bounded.
"""

from __future__ import annotations

from .request import Request

POLICY_NAMES = ("fcfs", "priority", "short_first")


class SchedulingPolicy:
    """Order of service: lower `sort_key` runs first and is preempted last.

    Subclass and override `sort_key` for your own order (e.g. by tenant or deadline).
    `yields_prefill`: a waiting request that ranks ahead of a running one still in its
    prefill gets its tokens first (off for fcfs and priority: today's behaviour).
    """

    name = "fcfs"
    yields_prefill = False

    def sort_key(self, request: Request) -> tuple:
        return (request.arrival_time, request.arrival_seq)


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value first (as in vLLM), then first come first served."""

    name = "priority"

    def sort_key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time, request.arrival_seq)


def make_policy(policy: str | SchedulingPolicy) -> SchedulingPolicy:
    if isinstance(policy, SchedulingPolicy):
        return policy
    if policy == "fcfs":
        return SchedulingPolicy()
    if policy == "priority":
        return PriorityPolicy()
    if policy == "short_first":
        from .short_first import ShortFirstPolicy  # it subclasses SchedulingPolicy

        return ShortFirstPolicy()
    raise ValueError(
        "scheduling_policy must be 'fcfs', 'priority', 'short_first' or a SchedulingPolicy, "
        f"got {policy!r}"
    )
