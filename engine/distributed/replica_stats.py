"""What the replica engine reports about its replicas together: counters and scheduler stats
summed over the replicas (see ray_replicas.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..metrics import SchedulerStats, SpecDecodingStats

if TYPE_CHECKING:
    from .ray_replicas import RayReplicaEngine


class ReplicaCounters:
    """`counters`-like: `snapshot()` sums the replicas' engine counters."""

    def __init__(self, owner: RayReplicaEngine):
        self._owner = owner

    def snapshot(self) -> dict[str, Any]:
        per_replica = self._owner._on_replicas("counters")
        total: dict[str, Any] = {}
        for snap in per_replica:
            for key, value in snap.items():
                if key == "max_seqs_in_step":
                    total[key] = max(total.get(key, 0), value)
                elif isinstance(value, int | float):
                    total[key] = total.get(key, 0) + value
        if per_replica:
            total["kv_cache_usage"] = total.get("kv_cache_usage", 0.0) / len(per_replica)
        spec = SpecDecodingStats()  # rates are recomputed from the summed counts
        for snap in per_replica:
            spec.add(SpecDecodingStats.from_dict(snap))
        total.update(spec.as_dict())
        total["replicas"] = per_replica
        total["prefix_routed"] = self._owner.router.prefix_routed
        total["replicas_replaced"] = self._owner.replicas_replaced
        total["requests_retried"] = self._owner.requests_retried
        total["requests_resumed"] = self._owner.requests_resumed
        return total


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' scheduler stats added up; KV-cache usage is their mean."""
    total = SchedulerStats()
    for s in stats:
        for f in dataclasses.fields(SchedulerStats):
            if f.name != "kv_cache_usage":
                setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    total.kv_cache_usage = sum(s.kv_cache_usage for s in stats) / max(len(stats), 1)
    return total
