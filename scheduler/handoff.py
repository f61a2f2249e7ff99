"""Disaggregated prefill and decode, the scheduler's part: leases on a prefill engine,
copies into a decode engine's prefix cache.

Prefill side (`Leases`). A `handoff` request runs its prompt with `max_tokens` 1; when
it ends by its length, its blocks are not freed but leased: the block manager's table
moves from the sequence to the lease (a negative id that no sequence has), the full
prompt blocks are named in the last delta (`KvLease`), and the blocks stay referenced
until every rank of the decode engine has acknowledged its copy, the frontend's
`ReleaseKv` or `LEASE_S`, whichever comes first. Then they are freed like any finished
request's: into the prefix cache. Each lease has a slot in this engine's lease table in
shared memory (`ipc/kv_leases.py`), cleared before its blocks are freed: an importer
checks it after its copy, so a copy that outlived its lease is never used, however late
it ran; and acknowledges it there when done, which frees it on the next turn
(`expire`), not at the decode engine's first token, which may wait in its queue.

Decode side (`Imports`). A request with a `kv_source` does not queue at once: free blocks
are taken for a copy (a pseudo-sequence, again a negative id), every rank is told to
copy (`KvImport`), and when every rank has answered, the copied blocks are keyed into
this engine's prefix cache under the prompt's tokens and the pseudo-sequence lets go
of them. Then the request queues like any other, and its admission finds its prompt
cached: only the last, partial block is computed here. Any failure (no free blocks,
no prefix cache, a rank that could not copy, no answer within `IMPORT_TIMEOUT_S`)
queues the request all the same: it computes its prompt itself. A pseudo-sequence whose
answers have not all come is freed only when they have: a late copy may still be
writing its blocks.
"""

from __future__ import annotations

import time
import weakref
from array import array
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field

from subway.ipc.kv_leases import LeaseTable, read_incarnation, segment_name
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

# A copy is used only if answered within IMPORT_TIMEOUT_S of the request's arrival here.
# That it never read a block its lease had given back is the lease table's to show (the
# importer checks the lease after its copy), not this timing's: a request may reach this
# engine long after the lease's grant.
IMPORT_TIMEOUT_S = 10.0
MAX_ACKED_KEPT = 4096  # leases freed by their acks, remembered so that their ReleaseKv is quiet


class Leases:
    def __init__(
        self, sched: Scheduler, source: str, lease_s: float = LEASE_S,
        table: LeaseTable | None = None,
    ) -> None:  # fmt: skip
        """`source`: what leases name (`EngineConfig.kv_source`). `table`: made here by
        default, under this engine's shm prefix, recording its ranks' worker segments
        (made before the workers said they were ready, so before this)."""
        self.sched = sched
        self.source = source
        self.lease_s = lease_s
        if table is None:
            prefix, world = sched.config.ipc.kv_source, sched.config.parallel.tensor_parallel_size
            workers = [read_incarnation(segment_name(prefix, r)) for r in range(world)]
            table = LeaseTable(prefix, max(1, sched.block_manager.num_blocks), workers)
            weakref.finalize(self, table.close)  # if dropped; `close` at exit (else the tracker)
        self.table = table
        self.held: dict[int, tuple[float, int, int]] = {}  # lease id -> deadline, slot, gen
        self._acked: OrderedDict[int, None] = OrderedDict()  # freed by their acks, lately

    def grant(self, req: Request) -> KvLease | None:
        """Lease a handoff request's full prompt blocks as it finishes; None if it has none
        (or no slot is free: a lease holds a block at least, so with a slot a block, never)."""
        sched, bm = self.sched, self.sched.block_manager
        n = min(req.prompt_len, req.num_computed_tokens) // bm.block_size
        if n == 0:
            return None
        taken = self.table.grant()
        if taken is None:
            return None
        slot, generation = taken
        if sched.caching:
            sched.cache_blocks(req, req.num_computed_tokens)
        lease_id = -(req.seq_id + 1)
        bm.rename(req.seq_id, lease_id)
        self.held[lease_id] = (time.monotonic() + self.lease_s, slot, generation)
        sched.stats.kv_leases = len(self.held)
        blocks = bm.block_table(lease_id)[:n]
        return KvLease(lease_id, self.source, blocks, slot, generation, self.table.incarnation)

    def release(self, lease_id: int) -> bool:
        """Free a lease (the frontend's ReleaseKv); False if not held, unless its acks freed it."""
        held = self.held.pop(lease_id, None)
        if held is None:
            if lease_id in self._acked:  # freed by its acks already: its ReleaseKv is no news
                del self._acked[lease_id]
                return True
            return False  # expired already, or never ours
        self.table.revoke(held[1])  # before the free: no plan may write them while it holds
        self.sched.block_manager.free(lease_id)
        self.sched.stats.kv_leases = len(self.held)
        return True

    def close(self) -> None:
        """The scheduler exits: its lease table goes (its leases end with the engine)."""
        self.table.close()

    def expire(self, now: float) -> int:
        """Free the leases that every rank has acknowledged, and those past their time;
        the number of the latter."""
        acked = self.table.acked
        for lid in [lid for lid, (_, slot, gen) in self.held.items() if acked(slot, gen)]:
            self.release(lid)
            self._acked[lid] = None  # its ReleaseKv may still come
            if len(self._acked) > MAX_ACKED_KEPT:
                self._acked.popitem(last=False)
        late = [lid for lid, (deadline, _, _) in self.held.items() if deadline <= now]
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
        self.send(
            KvImport(pid, src.source, list(src.blocks), dst, src.slot, src.generation,
                     src.incarnation)
        )  # fmt: skip

    def requests(self) -> set[str]:
        return {c.msg.request_id for c in self.pending.values() if not c.queued}

    def abort(self, request_id: str) -> bool:
        """An abort for a request still waiting for its copy: it will not be queued."""
        for c in self.pending.values():
            if c.msg.request_id == request_id and not c.queued:
                c.aborted = c.queued = True
                n = len(c.ids)
                self.sched.push_delta(RequestDelta(request_id, [], "abort", num_prompt_tokens=n))
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
