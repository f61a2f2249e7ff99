"""Constrained decoding on rank 0: one xgrammar matcher per sequence with a grammar.

Under `subway serve` a grammar arrives once, in a `GrammarPrepare` (`prepare_key`),
and compiles on a thread of its own (xgrammar releases the GIL) while steps run;
rank 0 answers `GrammarReady` when it is done (`answers`), or as failed once it
has compiled for longer than the compile limit (`--grammar-timeout`, the
frontend's too; the compiler's own first build, seconds, does not count: rank 0 makes
it at the first grammar, on that compile's thread, not at start, where it took its CPU
from the first requests' steps). The scheduler holds the grammar's requests until then, so a compile never
holds up a step; a `NewSeq` names the grammar by its key (`Grammar.key`) and
gets a matcher of the compiled grammar. At most `_POOL_THREADS` compiles run at
once; one past its limit is abandoned (its thread cannot be stopped: it ends on
its own) and no longer counts, and past `_MAX_ABANDONED` such threads new
grammars fail at once. A `NewSeq` that carries its grammar's text (the offline
`LLM`, tests of the runner) compiles it the same way and joins the compile
when the sequence first samples. The compiler (and the tokenizer it needs) is
built on first use, on a compile thread, with its cache capped at
`CACHE_BYTES`: a schema seen before costs nothing.

Each step, `prepare` fills one preallocated bitmask for every constrained row
that samples, in one `batch_fill_next_token_bitmask` call; the sampler applies
it to its copy of the logits (`TokenMask.apply`, one call for the batch; a JSON row
within its last tokens is first narrowed to closing ones, `json_budget.py`); then
`GrammarStep.accept` advances all those matchers with their sampled tokens in
one `batch_accept_token` call. A terminated matcher (it accepted EOS: the step
the scheduler discards under overlap) gets no mask and accepts nothing.

A matcher's history is always a prefix of its sequence's generated tokens
(`accepted` of them), so when the runner truncates a sequence (a token the
scheduler discarded) the matcher rolls back by what it accepted beyond the new
length. Preemption keeps the tokens, hence the matcher. A matcher that refuses a
sampled token (it cannot happen: a masked token is never sampled) says so once
and leaves its sequence unconstrained, the prefix rule intact, until a
truncation removes that token.

A grammar that fails to compile (the frontend compiles every grammar first, so
this is a guard) raises `GrammarError` from `prepare`; the runner fails the
step's sequences with it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from subway.ipc import grammar_build
from subway.ipc.messages import Grammar, GrammarReady
from subway.worker.json_budget import ClosingSet, Row, window_from_env

if TYPE_CHECKING:  # imported where a grammar is first used: 2 s of a worker's start
    import xgrammar as xgr

_POOL_THREADS = 2  # compiles in flight at once; each compile has its own threads below
_MAX_ABANDONED = 8  # compile threads past their limit, still running, at most
_COMPILER_THREADS = min(4, os.cpu_count() or 1)
CACHE_BYTES = 64 << 20  # what the compiler keeps of compiled grammars, at most


class GrammarError(ValueError):
    """A grammar that does not compile (the frontend checks them first: this is a guard)."""


def compile_grammar(compiler: xgr.GrammarCompiler, grammar: Grammar) -> xgr.CompiledGrammar:
    """`grammar` compiled by `compiler` (cached there); GrammarError if it does not compile."""
    try:
        return grammar_build.compile_grammar(compiler, grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"a {grammar.kind} grammar that does not compile: {e}") from e


@dataclass
class TokenMask:
    """The allowed tokens of some rows of one step: `bitmask` row r (on the logits' device)
    for each r in `rows`; the other rows are untouched."""

    bitmask: torch.Tensor  # int32 [>= max(rows) + 1, ceil(vocab / 32)]
    rows: list[int]
    ext: object | None = None  # the CPU kernels (`subway_kernels/csrc/mask_cpu.cpp`), or None
    closing: ClosingSet | None = None  # the vocabulary's closing tokens (`json_budget.py`)

    def apply(self, scores: torch.Tensor, requests: Sequence[Row] = ()) -> None:
        """Disallowed tokens of `rows` to -inf, in place, in one call for the batch: our CPU
        kernel where it applies (30x xgrammar's on a JSON schema's mask), else xgrammar's.
        `requests` (the batch's rows): those in their closing window are narrowed first."""
        if self.closing is not None and requests:
            self.closing.apply(self.bitmask, self.rows, requests)
        if (
            self.ext is not None
            and scores.device.type == "cpu"
            and scores.dtype == torch.float32
            and scores.is_contiguous()
        ):
            self.ext.apply_token_bitmask(scores, self.bitmask, self.rows)
            return
        import xgrammar as xgr  # imported once, by the first grammar (TYPE_CHECKING above)

        xgr.apply_token_bitmask_inplace(
            scores, self.bitmask, vocab_size=scores.shape[1], indices=self.rows
        )


@dataclass
class _Constrained:
    """One sequence's grammar: its compile, then its matcher."""

    compiled: Future
    matcher: xgr.GrammarMatcher | None = None
    accepted: int = 0  # generated tokens the matcher holds (a prefix of the sequence's)
    broken: bool = False  # it refused a sampled token: no longer constrained (see accept)


@dataclass
class _Prepared:
    """A grammar sent by key: its compile, and whether rank 0 has answered for it."""

    compiled: Future  # its `subway_started`: time.monotonic() when the compile began
    answered: bool = False


@dataclass
class GrammarStep:
    """The constrained rows of one step: their mask, then `accept` with the sampled tokens."""

    mask: TokenMask
    states: list[_Constrained] = field(default_factory=list)

    def accept(self, tokens: list[int]) -> None:
        """Advance every masked row's matcher by its token (`tokens` in row order), at once."""
        import xgrammar as xgr

        states = self.states
        chosen = [tokens[r] for r in self.mask.rows]
        ok = xgr.BatchGrammarMatcher.batch_accept_token([s.matcher for s in states], chosen)
        for s, good in zip(states, ok, strict=True):
            if good:
                s.accepted += 1
            else:  # only a masked token could be refused, and masked tokens are never sampled
                s.broken = True
                print("subway worker: a grammar refused a sampled token", file=sys.stderr)


class Grammars:
    """Rank 0's grammar state for every constrained sequence (see the module docstring)."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        max_rows: int,
        ext: object | None = None,
        compile_timeout: float = 10.0,
        closing_window: int | None = None,
    ) -> None:
        """`ext`: the compiled CPU kernels, whose mask kernel then serves (`TokenMask`).
        `compile_timeout`: seconds a compile may take before its grammar counts as failed.
        `closing_window`: a JSON's closing window (`json_budget.py`; None: from the environment)."""
        self.tokenizer_path = tokenizer_path
        self.ext = ext
        self.max_rows = max_rows  # the bitmask's rows: sampled rows of a step, at most
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.closing_window = window_from_env() if closing_window is None else closing_window
        self.closing: ClosingSet | None = None  # made with the compiler, if the window is > 0
        self.seqs: dict[int, _Constrained] = {}
        self.compile_timeout = compile_timeout
        self.keyed: dict[int, _Prepared] = {}  # grammars by key, until released
        self.unanswered = 0  # of those, the ones `answers` has not answered for yet
        self._queue: deque[tuple[Future, Grammar]] = deque()  # compiles not yet started
        self._running = 0  # compile threads within their limit
        self._abandoned = 0  # compile threads past their limit, still running
        self._lock = threading.Lock()  # the three counts above, shared with the threads
        self._wake_r, self._wake_w = os.pipe()  # a byte per finished compile (`wake_fd`)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the loop
        self._closed = False
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._host_mask: torch.Tensor | None = None  # int32 [rows, words], pinned on CUDA
        self._device_mask: torch.Tensor | None = None  # its copy on the device (CUDA only)

    @property
    def active(self) -> bool:
        return bool(self.seqs)

    # ------------------------------------------------------------------ lifecycle

    def add(self, seq_id: int, grammar: Grammar) -> None:
        """A new sequence's grammar: by key (compiled already, see `prepare_key`), or its text,
        compiled now and joined when the sequence samples."""
        self.forget([seq_id])
        if grammar.key:
            prepared = self.keyed.get(grammar.key)
            if prepared is None:
                compiled: Future = Future()
                compiled.set_exception(GrammarError(f"grammar {grammar.key} was never prepared"))
            else:
                compiled = prepared.compiled
        else:
            compiled = self._submit(grammar)
        self.seqs[seq_id] = _Constrained(compiled)

    def prepare_key(self, key: int, grammar: Grammar) -> None:
        """Start compiling a grammar that sequences will name by `key`; `answers` tells when
        it is done."""
        if key in self.keyed:
            return  # sent again (it was never released): the first answer stands
        with self._lock:
            saturated = self._abandoned >= _MAX_ABANDONED
        if saturated:
            failed: Future = Future()
            failed.set_exception(GrammarError("too many grammars past their compile limit"))
            self.keyed[key] = _Prepared(failed)
        else:
            self.keyed[key] = _Prepared(self._submit(grammar))
        self.unanswered += 1

    def release(self, keys: list[int]) -> None:
        """No new sequence will name these grammars (ones that have them keep them)."""
        for key in keys:
            p = self.keyed.pop(key, None)
            if p is not None and not p.answered:
                self.unanswered -= 1

    @property
    def wake_fd(self) -> int:
        """Readable when a compile has finished: the worker's poller wakes for `answers`."""
        return self._wake_r

    def answers(self, now: float | None = None) -> list[GrammarReady]:
        """One answer for each prepared grammar that compiled, failed, or passed its limit
        since the last call."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        now = time.monotonic() if now is None else now
        out: list[GrammarReady] = []
        for key, p in self.keyed.items():
            if p.answered:
                continue
            if p.compiled.done():
                error = p.compiled.exception()
                out.append(GrammarReady(key, error is None, "" if error is None else str(error)))
            elif now - getattr(p.compiled, "subway_started", now) > self.compile_timeout:
                self._abandon(p.compiled)
                limit = f"{self.compile_timeout:g}"
                out.append(GrammarReady(key, False, f"the grammar took over {limit} s to compile"))
            else:
                continue
            p.answered = True
            self.unanswered -= 1
        return out

    def forget(self, seq_ids: list[int]) -> None:
        seqs = self.seqs
        for sid in seq_ids:
            seqs.pop(sid, None)

    def truncate(self, seq_id: int, generated: int) -> None:
        """The sequence keeps only its first `generated` generated tokens: roll its matcher
        back to them (a refused token among those removed no longer counts)."""
        state = self.seqs.get(seq_id)
        generated = max(generated, 0)
        if state is None or state.matcher is None or generated > state.accepted:
            return
        if state.accepted > generated:
            state.matcher.rollback(state.accepted - generated)
        state.accepted = generated
        state.broken = False

    def close(self) -> None:
        """Stop starting compiles and let go of xgrammar's objects now, in order, while the
        interpreter is whole. Compile threads are daemons: one still running (past its
        limit) does not hold the process's exit."""
        with self._lock:
            self._closed = True
            self._queue.clear()
        self.seqs.clear()
        self.keyed.clear()
        self._batch = None
        self._compiler = None  # (the wake pipe stays open: a compile thread may still write)

    # ------------------------------------------------------------------ one step

    def prepare(self, seq_ids: list[int]) -> GrammarStep | None:
        """The mask of this step's sampling rows (`seq_ids` in row order), or None when no
        row is constrained. Joins pending compiles; GrammarError if one failed."""
        import xgrammar as xgr

        seqs = self.seqs
        rows: list[int] = []
        states: list[_Constrained] = []
        for r, sid in enumerate(seq_ids):
            state = seqs.get(sid)
            if state is None or state.broken:
                continue
            if state.matcher is None:
                try:
                    compiled = state.compiled.result()
                except Exception as e:  # a bad grammar, or no tokenizer to compile it with
                    raise GrammarError(f"seq {sid}: {e}") from e
                state.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
            if state.matcher.is_terminated():
                continue
            rows.append(r)
            states.append(state)
        if not rows:
            return None
        host = self._mask_rows(len(seq_ids))
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(_COMPILER_THREADS)
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], host, rows)
        bitmask = host
        if self.device.type != "cpu":
            n = rows[-1] + 1
            bitmask = self._device_mask[:n]
            bitmask.copy_(host[:n], non_blocking=True)
        return GrammarStep(TokenMask(bitmask, rows, self.ext, self.closing), states)

    # ------------------------------------------------------------------ pieces

    def _mask_rows(self, n: int) -> torch.Tensor:
        """The host bitmask, allocated on first use with `max_rows` rows (more if asked)."""
        if self._host_mask is None or self._host_mask.shape[0] < n:
            import xgrammar as xgr

            rows = max(n, self.max_rows)
            host = xgr.allocate_token_bitmask(rows, self.vocab_size)
            if self.device.type == "cuda":
                host = host.pin_memory()
            if self.device.type != "cpu":
                self._device_mask = torch.empty_like(host, device=self.device)
            self._host_mask = host
        return self._host_mask

    def _submit(self, grammar: Grammar) -> Future:
        """A future of `grammar` compiled: started now if fewer than `_POOL_THREADS` run."""
        future: Future = Future()
        with self._lock:
            self._queue.append((future, grammar))
        self._start_next()
        return future

    def _start_next(self) -> None:
        with self._lock:
            if self._closed or self._running >= _POOL_THREADS or not self._queue:
                return
            future, grammar = self._queue.popleft()
            self._running += 1
        future.set_running_or_notify_cancel()
        threading.Thread(
            target=self._compile, args=(future, grammar), name="subway-grammar", daemon=True
        ).start()

    def _compile(self, future: Future, grammar: Grammar) -> None:
        try:
            compiler = self.compiler()  # built once (seconds): not the grammar's time
            future.subway_started = time.monotonic()  # type: ignore[attr-defined]
            result = compile_grammar(compiler, grammar)
        except Exception as e:  # noqa: BLE001 - a bad grammar, or no tokenizer to compile it
            error: BaseException | None = e
        else:
            error = None
        with self._lock:
            abandoned = getattr(future, "subway_abandoned", False)
            if abandoned:
                self._abandoned -= 1
            else:
                self._running -= 1
            closed = self._closed
        try:  # unless abandoned meanwhile (then it holds its GrammarError)
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        except InvalidStateError:
            pass
        if not closed:
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass
            self._start_next()

    def _abandon(self, future: Future) -> None:
        """A compile past its limit stops counting against `_POOL_THREADS` (its thread runs
        on: xgrammar cannot be interrupted); the next compile starts."""
        with self._lock:
            if future.done() or getattr(future, "subway_abandoned", False):
                return
            if future.running():
                future.subway_abandoned = True  # type: ignore[attr-defined]
                self._running -= 1
                self._abandoned += 1
            else:  # still queued: it never starts
                self._queue = deque(item for item in self._queue if item[0] is not future)
            try:
                future.set_exception(GrammarError("the grammar took too long to compile"))
            except InvalidStateError:  # it finished just now
                pass
        self._start_next()

    def compiler(self) -> xgr.GrammarCompiler:
        """The worker's compiler, built once from the model's tokenizer (off the step's path)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                if self.closing_window > 0:  # before the first compile ends: before any mask
                    self.closing = ClosingSet.of_vocab(
                        info.decoded_vocab, info.stop_token_ids, self.vocab_size,
                        self.closing_window,
                    )  # fmt: skip
                self._compiler = xgr.GrammarCompiler(
                    info,
                    max_threads=_COMPILER_THREADS,
                    cache_enabled=True,
                    cache_limit_bytes=CACHE_BYTES,
                )
            return self._compiler
