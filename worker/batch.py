"""A step's batch: the plan's sequences laid out as the forward pass's inputs.

`build_batch` checks every SeqStep against the worker's copy of its sequence
(a PlanError, found before any collective, on every rank alike), grows block
tables, and flattens the step into attention rows: one per sequence, or one
per position of a sequence with a draft (`speculative.draft_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from subway.ipc.messages import SamplingParams, SeqStep
from subway.kernels.attention import positions_and_slots
from subway.worker.grammar import Grammars
from subway.worker.pooling import PoolingTracker
from subway.worker.prompt_logprobs import PromptLogprobTracker
from subway.worker.speculative import draft_rows


class PlanError(ValueError):
    """A plan this worker cannot run as given (unknown sequence, positions past its tokens
    or blocks, token ids outside the vocabulary). Found before any collective, on every
    rank alike, so the step fails for its requests and the worker serves on."""


@dataclass
class SeqState:
    tokens: list[int]  # prompt, then every token sampled for it
    prompt_len: int
    sampling: SamplingParams
    block_table: list[int] = field(default_factory=list)
    lora: int = 0  # its LoRA adapter (`worker/lora.py`); 0: none


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's inputs, per sequence (`steps`, `states`, `ends`) and per attention row."""

    steps: list[SeqStep]  # the plan's steps that run, in plan order
    states: list[SeqState]  # their sequences
    input_ids: list[int]  # step after step; a draft after its sequence's own tokens
    ends: np.ndarray  # per sequence: where its inputs end
    qlens: np.ndarray  # per attention row: query tokens
    ctx: np.ndarray  # per attention row: where its context ends
    tables: np.ndarray  # per attention row: its sequence's block table, zero-padded
    positions: np.ndarray  # per input token
    slots: np.ndarray  # per input token: its KV cache slot
    sampling: list[int]  # the steps that sample
    seq_ids: list[int]  # their sequences
    sampled_rows: list[int]  # the attention rows that sample (a drafted sequence's every row)
    drafted: bool  # some sequence carries a draft
    plp_idx: np.ndarray | None  # prompt-logprob rows (rank 0, prefills that asked) ...
    plp_slices: list[tuple[int, int, int]] | None  # ... and the prompt slices they score
    pool_idx: np.ndarray | None = None  # pooled rows (rank 0, embedding prefills) ...
    pool_slices: list[tuple[int, int, int]] | None = None  # ... and the positions they are

    @property
    def extra_rows(self) -> bool:
        """Whether some hidden states beyond the sampled rows are needed (no CUDA graph)."""
        return bool(self.plp_slices or self.pool_slices)

    def row_seq_ids(self) -> list[int]:
        """Each sampled row's sequence: a drafted sequence's once per row."""
        if not self.drafted:
            return self.seq_ids
        steps = self.steps
        return [steps[i].seq_id for i in self.sampling for _ in range(1 + len(steps[i].draft))]


def check_draft(step_no: int, step: SeqStep, st: SeqState, vocab_size: int) -> None:
    """A draft rides only on a sampled decode, after its one token of its own, within
    the vocabulary, and never for a constrained sequence (on every rank alike)."""
    d = step.draft
    if (
        not step.sample
        or len(d) != step.num_tokens - 1  # a decode: one token of its own
        or min(d) < 0
        or max(d) >= vocab_size
        or st.sampling.grammar is not None
    ):
        raise PlanError(f"step {step_no}: seq {step.seq_id} has a draft it cannot verify")


def build_batch(
    step_no: int,
    steps: list[SeqStep],
    seqs: dict[int, SeqState],
    num_blocks: int,
    block_size: int,
    vocab_size: int,
    grammars: Grammars,
    prompt_lps: PromptLogprobTracker | None,
    pooling: PoolingTracker | None = None,
    num_groups: int = 1,
    holes: bool = False,
) -> Batch:
    """Plan `step_no`'s `steps` as a batch; `prompt_lps` where this rank scores prompts,
    `pooling` where it pools them. With `num_groups` KV groups (`ipc/kv_groups.py`) the
    tables are flat and `slots` are group 0's (`worker/kv_pages.py` makes the others');
    `holes`: some group slides, so a table may hold -1 (`_grow`)."""
    qlens, ends, input_ids, states, drafted = _gather(
        step_no, steps, seqs, num_blocks, block_size, vocab_size, grammars, (num_groups, holes)
    )
    tables = np.zeros((len(steps), max(len(st.block_table) for st in states)), dtype=np.int32)
    for i, st in enumerate(states):
        tables[i, : len(st.block_table)] = st.block_table
    sampling = [i for i, step in enumerate(steps) if step.sample]
    plp_idx, plp_slices = None, None
    if prompt_lps is not None:
        plp_idx, plp_slices = prompt_lps.rows(steps, qlens)
    pool_idx, pool_slices = None, None
    if pooling is not None:
        pool_idx, pool_slices = pooling.rows(steps, qlens)
    sampled_rows = sampling  # one row per sequence, without drafts
    ctx = ends
    if drafted:  # a draft's positions as one-token rows (same tokens, same order)
        qlens, ctx, row_of = draft_rows([len(s.draft) for s in steps], qlens, ends)
        tables = tables[row_of]
        sampled_rows = [r for r, i in enumerate(row_of.tolist()) if steps[i].sample]
    head = tables if num_groups == 1 else tables[:, ::num_groups]
    positions, slots = positions_and_slots(qlens, ctx, head, block_size)
    return Batch(
        steps=steps,
        states=states,
        input_ids=input_ids,
        ends=ends,
        qlens=qlens,
        ctx=ctx,
        tables=tables,
        positions=positions,
        slots=slots,
        sampling=sampling,
        seq_ids=[steps[i].seq_id for i in sampling],
        sampled_rows=sampled_rows,
        drafted=drafted,
        plp_idx=plp_idx,
        plp_slices=plp_slices,
        pool_idx=pool_idx,
        pool_slices=pool_slices,
    )


def _gather(
    step_no: int,
    steps: list[SeqStep],
    seqs: dict[int, SeqState],
    num_blocks: int,
    block_size: int,
    vocab_size: int,
    grammars: Grammars,
    layout: tuple[int, bool],
) -> tuple[np.ndarray, np.ndarray, list[int], list[SeqState], bool]:
    """Check each step against its sequence, grow its block table, and drop a later token
    the scheduler discarded: query lengths, input ends, input ids, states, any draft."""
    n = len(steps)
    qlens = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    input_ids: list[int] = []
    states: list[SeqState] = []
    drafted = False
    num_groups = layout[0]
    for i, step in enumerate(steps):
        st = seqs.get(step.seq_id)
        if st is None:
            raise PlanError(f"step {step_no}: unknown seq {step.seq_id}")
        if step.new_blocks:
            _grow(step_no, st.block_table, step.new_blocks, num_blocks, layout)
        end = step.start_pos + step.num_tokens
        own = end  # positions fed from its own tokens; a draft's come after them
        if step.draft:
            check_draft(step_no, step, st, vocab_size)
            own = end - len(step.draft)
            drafted = True
        if (
            step.start_pos < 0
            or own <= step.start_pos
            or own > len(st.tokens)
            or end > len(st.block_table) // num_groups * block_size
        ):
            raise PlanError(
                f"step {step_no}: seq {step.seq_id} asks for positions up to {end} but the "
                f"worker has {len(st.tokens)} tokens and {len(st.block_table)} blocks"
            )
        input_ids += st.tokens[step.start_pos : own]
        if step.draft:
            input_ids += step.draft
        if step.sample and len(st.tokens) > own:
            del st.tokens[own:]  # a later token the scheduler discarded; the sample replaces it
            if grammars.active:
                grammars.truncate(step.seq_id, own - st.prompt_len)
        qlens[i] = step.num_tokens
        ends[i] = end
        states.append(st)
    return qlens, ends, input_ids, states, drafted


def _grow(
    step_no: int, table: list[int], new: list[int], num_blocks: int, layout: tuple[int, bool]
) -> None:
    """Append a step's new blocks: ids in the pool, whole blocks of every group. Where a
    group slides, a -1 is a page its window released (behind the window of the step's
    first position): never read, it reads as block 0 here, as table padding does."""
    groups, holes = layout
    lo = -1 if holes else 0
    if min(new) < lo or max(new) >= num_blocks or len(new) % groups:
        raise PlanError(f"step {step_no}: a block id outside [0, {num_blocks}), or a part block")
    table.extend(new if lo == 0 or min(new) >= 0 else [max(b, 0) for b in new])
