"""Fair shares of one scheduler step across clients (`Request.client_id`).

The server tags each request with the client that sent it (engine requests made in process
carry no client: one client, and the scheduler behaves as it always did). When requests of
more than one client want tokens in the same step:

- the step's token budget is split by water-filling: every client may use up to the same
  level, and what a client does not need is shared by the others (`level`), so one client's
  long prompts take its share of each step, not the whole step;
- a decode (one token) is never held back, but it counts against its client's share;
- the next waiting request admitted is the best-ranked one of the client with the fewest
  running requests (`pick`), so a burst from one client does not queue every other
  client's requests behind it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from .request import Request


class StepShares:
    """Per-step bookkeeping of what each client may still use and has used."""

    def __init__(self, running: list[Request], waiting: list[Request], budget: int) -> None:
        demand: dict[str | None, int] = defaultdict(int)
        for request in _chain(running, waiting):
            demand[request.client_id] += request.num_tokens - request.num_computed_tokens
        self.active = len(demand) > 1
        self.level = budget
        if self.active:
            self.level = max(_water_level(list(demand.values()), budget), 1)
        self.used: dict[str | None, int] = defaultdict(int)

    def cap(self, request: Request) -> int:
        """Tokens this request's client may still take in this step."""
        if not self.active:
            return self.level
        return self.level - self.used[request.client_id]

    def charge(self, request: Request, num_tokens: int) -> None:
        self.used[request.client_id] += num_tokens

    def pick(
        self, waiting: list[Request], running: list[Request], excluded: set[str | None]
    ) -> int | None:
        """Index in `waiting` of the next request to admit, or None."""
        if not self.active:
            return 0 if waiting and not excluded else None
        counts = Counter(request.client_id for request in running)
        best: tuple[int, int] | None = None
        seen: set[str | None] = set()
        for index, request in enumerate(waiting):
            client = request.client_id
            if client in seen or client in excluded:
                continue
            seen.add(client)
            candidate = (counts[client], index)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else best[1]


def _water_level(demands: list[int], budget: int) -> int:
    """The largest level L with sum(min(d, L)) <= budget (every demand when they all fit)."""
    remaining = budget
    ordered = sorted(demands)
    for position, demand in enumerate(ordered):
        fair = remaining // (len(ordered) - position)
        if demand > fair:
            return fair
        remaining -= demand
    return ordered[-1] if ordered else budget


def _chain(*groups: Iterable[Request]) -> Iterable[Request]:
    for group in groups:
        yield from group
