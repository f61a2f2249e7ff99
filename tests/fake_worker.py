"""A torch-free stand-in for the worker, for the scheduler's tests: an `Executor` of `EngineCore`.

`FakeWorker` keeps what a real worker keeps (each sequence's tokens, its
block table, the KV cache) and checks every promise a plan makes. Its "KV" at
position p of a sequence is a digest of the sequence's tokens 0..p, written
into the slot the block table names; before it samples, it reads the whole
context back through the block table and checks every slot. A block shared
by prefix caching that held the wrong prefix, or was overwritten by another
sequence, or a sequence writing into a block someone else holds, fails there.
It "samples" with a function of the sequence's tokens (a hash by default), so
outputs can be compared with a reference that generates each request alone.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable

from subway.ipc.messages import Plan, StepResult, TokenRef
from subway.scheduler.engine_core import LazyExecutor


def hash_sampler(vocab: int) -> Callable[[list[int]], int]:
    def sample(tokens: list[int]) -> int:
        return zlib.crc32(array("i", tokens)) % vocab

    return sample


class FakeWorker(LazyExecutor):
    """Applies plans as a worker would, asserting the scheduler's promises."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        sample: Callable[[list[int]], int] | None = None,
        check_kv: bool = True,
        keep_plans: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sample = sample or hash_sampler(40)
        self.check_kv = check_kv
        self.keep_plans = keep_plans
        self.tokens: dict[int, list[int]] = {}
        self.kv: dict[int, int] = {}  # KV length each sequence has (positions 0 .. kv - 1)
        self.tables: dict[int, list[int]] = {}
        self.holders: list[set[int]] = [set() for _ in range(num_blocks)]
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self._digests: dict[int, list[int]] = {}
        super().__init__()
        self.plans: list[Plan] = []
        self.num_steps = 0
        self.num_tokens_computed = 0  # positions written (prefill and decode), all steps
        self.num_drafted = 0  # speculative decoding: draft tokens verified,
        self.num_accepted = 0  # and accepted

    @property
    def owner(self) -> dict[int, int]:
        """block -> the sequence holding it, for blocks held by exactly one."""
        return {b: next(iter(h)) for b, h in enumerate(self.holders) if len(h) == 1}

    def _digest(self, sid: int, p: int) -> int:
        d = self._digests.setdefault(sid, [])
        toks = self.tokens[sid]
        while len(d) <= p:
            d.append(hash((d[-1] if d else 0x5EED, toks[len(d)])))
        return d[p]

    def _drop_blocks(self, sid: int) -> None:
        for b in self.tables.get(sid, []):
            self.holders[b].remove(sid)
        self.tables[sid] = []
        self.kv[sid] = 0

    def run(self, plan: Plan) -> tuple[StepResult, list[int]]:
        if self.keep_plans:
            self.plans.append(plan)
        self.num_steps += 1
        bs = self.block_size
        for sid in plan.finished:
            assert sid in self.tokens, f"finished {sid} was never sent"
            self._drop_blocks(sid)
            del self.tokens[sid], self.kv[sid], self.tables[sid]
            self._digests.pop(sid, None)
        for sid in plan.preempted:
            assert sid in self.tokens, f"preempted {sid} is unknown"
            self._drop_blocks(sid)
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.tokens, "NewSeq sent twice"
            assert ns.prompt.ids is not None, "the fake worker needs prompts inline"
            self.tokens[ns.seq_id] = list(ns.prompt.ids)
            self.kv[ns.seq_id] = 0
            self.tables[ns.seq_id] = []
        seen = set()
        out_ids, out_tokens, counts = [], [], []
        for s in plan.seqs:
            sid = s.seq_id
            assert sid in self.tokens, f"sequence {sid} scheduled before its NewSeq"
            assert sid not in seen, "a sequence twice in one plan"
            seen.add(sid)
            assert s.num_tokens > 0
            table = self.tables[sid]
            if table:
                assert s.start_pos == self.kv[sid], "KV positions must be contiguous"
            else:  # first step since NewSeq or preemption: a cached prefix may be there
                assert s.start_pos % bs == 0, "a cached prefix is whole blocks"
                assert len(s.new_blocks) * bs > s.start_pos
            for b in s.new_blocks:
                assert 0 <= b < self.num_blocks
                assert b not in table, f"block {b} twice in the table of {sid}"
                if self.holders[b]:  # a shared block: only ever read, never written
                    assert (len(table) + 1) * bs <= s.start_pos, (
                        f"block {b} given to {sid} while {self.holders[b]} holds it"
                    )
                self.holders[b].add(sid)
                table.append(b)
            end = s.start_pos + s.num_tokens
            draft = list(s.draft)
            own = end - len(draft)  # fed from its own tokens; then the draft
            assert -(-end // bs) <= len(table) <= -(-(end + 16) // bs), "blocks != needed"
            toks = self.tokens[sid]
            assert own <= len(toks), "fed a token the worker does not have"
            if draft:
                assert s.sample and own > s.start_pos, "a draft after no token of its own"
            chain = self._digest(sid, own - 1) if draft and own > 0 else None
            for p in range(s.start_pos, end):
                b = table[p // bs]
                assert self.holders[b] == {sid}, f"{sid} writes into block {b}, shared with " + str(
                    self.holders[b] - {sid}
                )
                if self.check_kv:
                    if p < own:
                        self.slots[b][p % bs] = self._digest(sid, p)
                    else:  # a draft position: its digest over the draft, not yet known tokens
                        chain = hash((chain, draft[p - own]))
                        self.slots[b][p % bs] = chain
            self.num_tokens_computed += s.num_tokens
            if s.sample:
                assert own == len(toks), "sampled from a position that is not the last"
                if self.check_kv:
                    for p in range(own):
                        got = self.slots[table[p // bs]][p % bs]
                        assert got == self._digest(sid, p), f"seq {sid}: wrong KV at position {p}"
                # Sample every fed draft position; keep the run that matches, and one more.
                emitted = [self.sample(toks)]
                while len(emitted) <= len(draft) and emitted[-1] == draft[len(emitted) - 1]:
                    emitted.append(self.sample(toks + draft[: len(emitted)]))
                toks += emitted
                self.kv[sid] = own + len(emitted) - 1  # the rejected draft's KV is garbage
                out_ids.append(sid)
                out_tokens += emitted
                counts.append(len(emitted))
                self.num_drafted += len(draft)
                self.num_accepted += len(emitted) - 1
            else:
                self.kv[sid] = end
        result = StepResult(step=plan.step, seq_ids=out_ids, tokens=TokenRef(ids=out_tokens))
        if any(c > 1 for c in counts):
            result.num_tokens = counts
        return result, out_tokens
