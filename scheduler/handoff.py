"""Disaggregated prefill and decode, the scheduler's part: leases on a prefill engine,
copies into a decode engine's prefix cache.

Prefill side (`Leases`). A `handoff` request runs its prompt with `max_tokens` 1; when
it ends by its length, its blocks are not freed but leased: the block manager's table
moves from the sequence to the lease (a negative id that no sequence has), the full
prompt blocks are named in the last delta (`KvLease`), and the blocks stay referenced
until the frontend's `ReleaseKv` or `LEASE_S`, whichever comes first. Then they are
freed like any finished request's: into the prefix cache.

Decode side (`Imports`). A request with a `kv_source` does not queue at once: free blocks
are taken for a copy (a pseudo-sequence, again a negative id), every rank is told to
copy (`KvImport`), and when every rank has answered, the copied blocks are keyed into
this engine's prefix cache under the prompt's tokens and the pseudo-sequence lets go
of them. Then the request queues like any other, and its admission finds its prompt
cached: only the last, partial block is computed here. Any failure (no free blocks,
no prefix cache, a rank that could not copy, no answer within `IMPORT_TIMEOUT_S`)
queues the request all the same: it computes its prompt itself. A pseudo-sequence
whose answers have not all come is freed only when they have: a late copy may still
be writing its blocks.
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field

from subway.ipc.messages import (
    KV_TRANSFER_BUCKETS,
    LEASE_S,
    AddRequest,
    KvImport,
    KvImported,
    KvLease,
    RequestDelta,
)
from subway.scheduler.block_manager import TOKEN_TYPE
from subway.scheduler.request import Request
from subway.scheduler.scheduler import Scheduler

# A copy is used only if answered within IMPORT_TIMEOUT_S of the request's arrival here,
# which comes within milliseconds of the lease's grant: well inside LEASE_S, so a copy
# that is used never read a block that its lease had already given back.
IMPORT_TIMEOUT_S = 10.0
assert IMPORT_TIMEOUT_S < LEASE_S / 2


class Leases:
    def __init__(self, sched: Scheduler, source: str, lease_s: float = LEASE_S) -> None:
        self.sched = sched
        self.source = source  # this engine's shared-memory prefix
        self.lease_s = lease_s
        self.held: dict[int, float] = {}  # lease id -> its deadline (time.monotonic())

    def grant(self, req: Request) -> KvLease | None:
        """Lease a handoff request's full prompt blocks as it finishes; None if it has none."""
        sched, bm = self.sched, self.sched.block_manager
        n = min(req.prompt_len, req.num_computed_tokens) // bm.block_size
        if n == 0:
            return None
        if sched.caching:
            sched.cache_blocks(req, req.num_computed_tokens)
        lease_id = -(req.seq_id + 1)
        bm.rename(req.seq_id, lease_id)
        self.held[lease_id] = time.monotonic() + self.lease_s
        sched.stats.kv_leases = len(self.held)
        return KvLease(lease_id, self.source, bm.block_table(lease_id)[:n])

    def release(self, lease_id: int) -> bool:
        if self.held.pop(lease_id, None) is None:
            return False  # expired already, or never ours
        self.sched.block_manager.free(lease_id)
        self.sched.stats.kv_leases = len(self.held)
        return True

    def expire(self, now: float) -> int:
        late = [lid for lid, deadline in self.held.items() if deadline <= now]
        for lid in late:
            self.release(lid)
        self.sched.stats.kv_leases_expired_total += len(late)
        return len(late)


@dataclass
class _Copy:
    msg: AddRequest
    ids: list[int]
    dst: list[int]
    started: float
    answers: dict[int, KvImported] = field(default_factory=dict)
    queued: bool = False  # the request went on without the copy (timed out or aborted)
    aborted: bool = False


class Imports:
    def __init__(self, sched: Scheduler, send: callable, world: int) -> None:  # type: ignore[valid-type]
        self.sched = sched
        self.send = send  # WorkerLink.send_import
        self.world = world
        self.pending: dict[int, _Copy] = {}  # pseudo-sequence id -> its copy
        self._next = 1
        self.buckets = [0] * len(KV_TRANSFER_BUCKETS)

    def add(self, msg: AddRequest, ids: list[int]) -> None:
        """A request with a `kv_source`: start its copy, or queue it now if none can be made."""
        src = msg.kv_source
        sched, bm = self.sched, self.sched.block_manager
        n = len(src.blocks) if src is not None else 0
        ok = (
            src is not None and sched.caching and 0 < n * bm.block_size <= len(ids)
            and msg.request_id not in self.requests() and sched.get(msg.request_id) is None
            and n <= bm.num_free_blocks
        )  # fmt: skip
        if not ok:
            if src is not None and n:
                sched.stats.kv_transfer_failures_total += 1
            sched.add(msg, ids)
            return
        pid = -self._next
        self._next += 1
        dst = bm.allocate(pid, n * bm.block_size)
        self.pending[pid] = _Copy(msg, ids, dst, time.monotonic())
        self.send(KvImport(pid, src.source, list(src.blocks), dst))

    def requests(self) -> set[str]:
        return {c.msg.request_id for c in self.pending.values() if not c.queued}

    def abort(self, request_id: str) -> bool:
        """An abort for a request still waiting for its copy: it will not be queued."""
        for c in self.pending.values():
            if c.msg.request_id == request_id and not c.queued:
                c.aborted = c.queued = True
                n = len(c.ids)
                self.sched.pending.append(
                    RequestDelta(request_id, [], "abort", num_prompt_tokens=n)
                )
                return True
        return False

    def on_answer(self, msg: KvImported) -> None:
        c = self.pending.get(msg.import_id)
        if c is None or msg.rank in c.answers:
            return  # not ours, or said twice: ignored (the link counts malformed ones)
        c.answers[msg.rank] = msg
        if len(c.answers) == self.world:
            self._done(msg.import_id, c)

    def _done(self, pid: int, c: _Copy) -> None:
        sched, bm, stats = self.sched, self.sched.block_manager, self.sched.stats
        del self.pending[pid]
        ok = all(a.ok for a in c.answers.values())
        if ok and not c.queued:
            tokens = array(TOKEN_TYPE, c.ids)
            bm.cache_blocks(pid, tokens, array(TOKEN_TYPE), len(c.dst) * bm.block_size)
            stats.kv_transfer_blocks_total += len(c.dst)
            seconds = max(a.seconds for a in c.answers.values())
            stats.kv_transfer_seconds_sum += seconds
            i = bisect_left(KV_TRANSFER_BUCKETS, seconds)
            for j in range(i, len(self.buckets)):
                self.buckets[j] += 1
            stats.kv_transfer_buckets = self.buckets
            stats.kv_transfer_count += 1
        elif not c.queued:
            stats.kv_transfer_failures_total += 1
        bm.free(pid)  # copied blocks stay cached (evictable) for the admission to find
        if not c.queued:
            sched.add(c.msg, c.ids)

    def expire(self, now: float) -> None:
        """Copies unanswered for `IMPORT_TIMEOUT_S`: their requests go on without them."""
        for c in self.pending.values():
            if not c.queued and now - c.started > IMPORT_TIMEOUT_S:
                c.queued = True
                self.sched.stats.kv_transfer_failures_total += 1
                self.sched.add(c.msg, c.ids)
