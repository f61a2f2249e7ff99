"""Which grammars the workers hold, and the requests that wait for one to compile.

A request with a grammar does not join the queue until rank 0 has compiled that
grammar: the scheduler sends its text once (`GrammarPrepare`, keyed by its
content hash) however many requests and sequences use it, holds the requests
(status COMPILING: no blocks, no place in the batch) until rank 0 answers
(`GrammarReady`), then queues them. So a slow compile makes its own requests
wait, never the batch, and the plans carry only the key. A compile that fails,
or that rank 0 does not answer within twice the compile time limit plus `ANSWER_SLACK_S`,
ends its requests with an error (rank 0 times the compile itself; this bound is the
backstop for an answer that never comes). When no live request uses a grammar any more,
a `GrammarRelease` lets the workers forget it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from subway.ipc.messages import (
    Grammar,
    GrammarPrepare,
    GrammarReady,
    GrammarRelease,
    SamplingParams,
    grammar_key,
)

if TYPE_CHECKING:
    from subway.scheduler.request import Request

# Beyond the compile limit, for rank 0's answer to come: the compile may queue behind
# another (two run at once), and the compiler's first build, seconds, is not in its limit.
ANSWER_SLACK_S = 30.0


@dataclass(slots=True, eq=False)
class _Entry:
    sent_at: float  # the scheduler's clock when its GrammarPrepare went out
    ready: bool = False
    refs: int = 0  # live requests that use it (held here or in the scheduler's queues)
    held: list[Request] = field(default_factory=list)  # COMPILING, in arrival order


class GrammarTable:
    """The scheduler's side of the grammars (see the module docstring)."""

    def __init__(self, compile_timeout: float) -> None:
        self.answer_within = 2 * compile_timeout + ANSWER_SLACK_S
        self.entries: dict[int, _Entry] = {}
        self.outbox: list[GrammarPrepare | GrammarRelease] = []  # for the workers, in order

    @staticmethod
    def by_key(sp: SamplingParams) -> tuple[SamplingParams, Grammar, int]:
        """`sp` as the workers get it (the grammar named by its key, its text left out),
        the grammar itself and its key."""
        g = sp.grammar
        assert g is not None
        key = grammar_key(g)
        slim = msgspec.structs.replace(g, spec="", key=key)
        return msgspec.structs.replace(sp, grammar=slim), g, key

    def hold(self, req: Request, grammar: Grammar, now: float) -> bool:
        """Count `req` as a user of its grammar (`req.grammar_key`); True if it must wait
        for the compile (it is then held here), False if the workers have it ready."""
        key = req.grammar_key
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(now)
            self.outbox.append(GrammarPrepare(key, grammar))
        entry.refs += 1
        if entry.ready:
            return False
        entry.held.append(req)
        return True

    def holding(self) -> bool:
        """Whether any request waits for a compile."""
        return any(e.held for e in self.entries.values())

    def unhold(self, req: Request) -> None:
        """`req` leaves before its compile answered (an abort)."""
        entry = self.entries.get(req.grammar_key)
        if entry is not None and req in entry.held:
            entry.held.remove(req)

    def drop(self, req: Request) -> None:
        """`req` has finished: one user fewer of its grammar."""
        entry = self.entries.get(req.grammar_key)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs <= 0:
            del self.entries[req.grammar_key]
            self.outbox.append(GrammarRelease([req.grammar_key]))  # in order with prepares

    def answer(self, msg: GrammarReady) -> tuple[list[Request], list[Request], str]:
        """Rank 0's answer: (requests now ready to queue, requests to fail, why)."""
        entry = self.entries.get(msg.key)
        if entry is None or entry.ready:
            return [], [], ""  # released meanwhile, or a second answer
        held, entry.held = entry.held, []
        if msg.ok:
            entry.ready = True
            return held, [], ""
        return [], held, msg.error or "the grammar did not compile"

    def overdue(self, now: float) -> list[Request]:
        """Requests whose grammar's answer is later than the compile limit allows."""
        out: list[Request] = []
        for entry in self.entries.values():
            if not entry.ready and entry.held and now - entry.sent_at > self.answer_within:
                out += entry.held
                entry.held = []
        return out

    def take_outbox(self) -> list[GrammarPrepare | GrammarRelease]:
        """What to send the workers now, in the order it happened."""
        out, self.outbox = self.outbox, []
        return out
