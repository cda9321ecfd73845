"""Which replica gets a request: the one most likely to hold its prefix in cache, else the
least loaded.

Prefixes are tracked with the same granularity as the engines' prefix caches: chained hashes
of the full blocks of the prompt's token ids,

    h_0 = H(salt, tokens[0:B]),  h_i = H(h_{i-1}, tokens[i*B:(i+1)*B])

(only the first `max_blocks` blocks). Each hash maps to the replica that last served a prompt
with that block; a new prompt goes to the replica of its deepest known hash, so requests that
share a long system prompt or document land where its KV blocks already are. A replica more
than `max_imbalance` requests busier than the least loaded one is skipped (a hot prefix must
not pin every request on one replica while the others idle).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int, salt: str | None = None
) -> list[int]:
    """Chained 64-bit hashes of the first full blocks of `token_ids` (at most max_blocks)."""
    hashes: list[int] = []
    parent = xxhash.xxh64_intdigest((salt or "").encode())
    full = min(len(token_ids) // block_size, max_blocks)
    for i in range(full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        data = parent.to_bytes(8, "little") + b"".join(
            int(t).to_bytes(4, "little", signed=False) for t in block
        )
        parent = xxhash.xxh64_intdigest(data)
        hashes.append(parent)
    return hashes


class PrefixAwareRouter:
    """Picks a replica index for each request; the caller reports starts and finishes.

    policy "prefix" (cache-aware, the default) or "round_robin" (the baseline). Not
    thread-safe: the replica engine calls it from its one client event-loop thread.
    """

    def __init__(
        self,
        num_replicas: int,
        block_size: int = 16,
        max_blocks: int = 128,
        max_imbalance: int = 8,
        capacity: int = 200_000,
        policy: str = "prefix",
    ):
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"router policy must be 'prefix' or 'round_robin', got {policy!r}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_imbalance = max_imbalance
        self.capacity = capacity
        self.policy = policy
        self.load = [0] * num_replicas  # requests in flight per replica
        self.available = [True] * num_replicas
        self._owner: OrderedDict[int, int] = OrderedDict()  # block hash -> replica (LRU)
        self._turn = itertools.count()
        self.prefix_routed = 0  # requests sent to a replica because of a known prefix

    def choose(
        self,
        token_ids: Sequence[int],
        salt: str | None = None,
        exclude: Iterable[int] = (),
    ) -> tuple[int, list[int]]:
        """The replica for a prompt, and the prompt's block hashes (pass them to `started`)."""
        excluded = set(exclude)
        candidates = [i for i, ok in enumerate(self.available) if ok and i not in excluded] or [
            i for i, ok in enumerate(self.available) if ok
        ]
        if not candidates:
            raise RuntimeError("no replica is available")
        hashes = prefix_block_hashes(token_ids, self.block_size, self.max_blocks, salt)
        if self.policy == "round_robin":
            return candidates[next(self._turn) % len(candidates)], hashes
        least = min(self.load[i] for i in candidates)
        for h in reversed(hashes):  # deepest shared block first
            owner = self._owner.get(h)
            if owner in candidates and self.load[owner] - least <= self.max_imbalance:
                self._owner.move_to_end(h)
                self.prefix_routed += 1
                return owner, hashes
        idle = [i for i in candidates if self.load[i] == least]
        return idle[next(self._turn) % len(idle)], hashes

    def started(self, replica: int, hashes: list[int]) -> None:
        """A request with these block hashes now runs on `replica` (its blocks will be there)."""
        self.load[replica] += 1
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def finished(self, replica: int) -> None:
        self.load[replica] = max(self.load[replica] - 1, 0)

    def set_available(self, replica: int, available: bool) -> None:
        """Mark a replica up or down; a replica that went down forgets its prefixes."""
        self.available[replica] = available
        if not available:
            self.load[replica] = 0
            for h in [h for h, owner in self._owner.items() if owner == replica]:
                del self._owner[h]
