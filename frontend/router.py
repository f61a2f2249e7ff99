"""Which data-parallel engine serves a request: the one holding the longest cached prefix
of its prompt, unless that one is overloaded; else the least loaded.

The record of each engine's prefix cache is a set of content digests (`ipc/prefix.py`),
kept up to date by the digests its scheduler reports with every turn's deltas (and in
full when this frontend says hello). A prompt's chain of block digests is walked
through each set from the first block: the number of leading blocks found is the
prefix that engine would serve from its cache.

Load is judged first by what this frontend knows at once: the sequences it has in
flight on each engine (waiting or running there), then by what the engines report a
step late: the sequences waiting in their queues, then the KV blocks in use. (Waiting
first would send a whole burst to one engine: every request of a burst is routed
before any engine's next report, and a stale report of one waiting sequence would
make the other engine win every time.) The preferred engine counts as overloaded when
it has more than `overload` sequences in flight beyond the least loaded one, so a
popular prefix cannot pile every request onto one engine: the others then compute it
and cache it too, and the traffic spreads over all that hold it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from subway.ipc.prefix import prompt_digests

OVERLOAD = 8  # more sequences in flight than on the least loaded engine: overloaded


@dataclass(frozen=True)
class Load:
    """An engine's load, as the router compares loads: `in_flight`, then `waiting`, then
    `kv_used` (fraction of its blocks)."""

    in_flight: int
    waiting: int
    kv_used: float

    def key(self) -> tuple[int, int, float]:
        return (self.in_flight, self.waiting, self.kv_used)


@dataclass(frozen=True)
class Route:
    engine: int
    reason: str  # "prefix": its cache holds the prompt's prefix; "least_loaded"; "overloaded"
    cached_blocks: int  # of the prompt's full blocks, held by that engine's cache


class PrefixRouter:
    def __init__(self, num_engines: int, block_size: int, overload: int = OVERLOAD) -> None:
        self.block_size = block_size
        self.overload = overload
        self.records: list[set[int]] = [set() for _ in range(num_engines)]
        self._next = 0  # where the search for the least loaded starts: ties go round

    def update(self, engine: int, stored: list[int], removed: list[int], reset: bool) -> None:
        """Engine `engine` reported digests; `reset`: `stored` is its whole cache."""
        record = self.records[engine]
        if reset:
            record.clear()
        record.difference_update(removed)
        record.update(stored)

    def forget(self, engine: int) -> None:
        """The engine is lost (or a new scheduler took its place): it holds nothing."""
        self.records[engine].clear()

    def cached_blocks(self, engine: int, digests: Sequence[int]) -> int:
        record = self.records[engine]
        n = 0
        for d in digests:
            if d not in record:
                break
            n += 1
        return n

    def choose(self, prompt_ids: Sequence[int], loads: Sequence[Load | None]) -> Route:
        """The engine for a prompt; `loads[i]` is None where engine i cannot serve now.
        Raises LookupError when none can."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise LookupError("no engine can serve")
        n = len(loads)
        start = self._next % n
        ordered = sorted(live, key=lambda i: (loads[i].key(), (i - start) % n))  # type: ignore[union-attr]
        least = ordered[0]
        self._next = least + 1
        if len(live) == 1 or not any(self.records[i] for i in live):
            return Route(least, "least_loaded", 0)
        # Only blocks a hit could use: the scheduler recomputes a fully cached prompt's last.
        max_blocks = (len(prompt_ids) - 1) // self.block_size
        digests = prompt_digests(prompt_ids, self.block_size, max_blocks)
        held = {i: self.cached_blocks(i, digests) for i in live}
        best = max(held.values())
        if best == 0:
            return Route(least, "least_loaded", 0)
        # Among the engines holding the longest prefix, the least loaded (`ordered` order).
        preferred = next(i for i in ordered if held[i] == best)
        floor = loads[least].in_flight  # type: ignore[union-attr]
        if loads[preferred].in_flight > floor + self.overload:  # type: ignore[union-attr]
            return Route(least, "overloaded", held[least])
        return Route(preferred, "prefix", best)
