"""Scheduling policies: which waiting sequence goes first, which running one is preempted.

A policy is a small object. The scheduler keeps its waiting queue sorted by
`key` (lowest first) and, when KV blocks run out, preempts the candidate with
the highest key. A policy whose keys change with time (aging, deadlines
approaching) sets `dynamic`, and the queue is re-sorted at every step.
`can_admit` lets a policy hold admissions back (static batching).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from subway.scheduler.request import Sequence


class Policy:
    name = "base"
    dynamic = False  # keys depend on time: re-sort the waiting queue every step

    def key(self, seq: Sequence) -> Any:
        """Sort key: lower is served first (and preempted last)."""
        raise NotImplementedError

    def refresh(self, now: float) -> None:
        """Called once per step before sorting when `dynamic` (to fix `now` for the keys)."""

    def pick_victim(self, candidates: Iterable[Sequence]) -> Sequence:
        """The running sequence to preempt when blocks run out: the one served last."""
        return max(candidates, key=self.key)

    def can_admit(self, num_running: int) -> bool:
        """Whether waiting sequences may be admitted now."""
        return True


class FCFS(Policy):
    """First come, first served, by arrival at the scheduler (seq ids are given in that order)."""

    name = "fcfs"

    def key(self, seq: Sequence) -> int:
        return seq.seq_id


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFS}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
