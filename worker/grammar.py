"""Constrained decoding on rank 0: one xgrammar matcher per sequence with a grammar.

A `NewSeq` whose sampling carries a `Grammar` starts its compile on a small
thread pool (xgrammar releases the GIL), so that it runs while the step's
forward pass does; the compile is joined when the sequence first samples, and
its matcher made then. The compiler (and the tokenizer it needs) is built on
first use, on the pool too, with the cache on: a schema seen before costs
nothing.

Each step, `prepare` fills one preallocated bitmask for every constrained row
that samples, in one `batch_fill_next_token_bitmask` call; the sampler applies
it to its copy of the logits (`TokenMask.apply`, one call for the batch); then
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from subway.ipc.messages import JSON_OBJECT_SCHEMA, Grammar

if TYPE_CHECKING:  # imported where a grammar is first used: 2 s of a worker's start
    import xgrammar as xgr

_POOL_THREADS = 2  # compiles in flight at once; each compile has its own threads below
_COMPILER_THREADS = min(4, os.cpu_count() or 1)


class GrammarError(ValueError):
    """A grammar that does not compile (the frontend checks them first: this is a guard)."""


def compile_grammar(compiler: xgr.GrammarCompiler, grammar: Grammar) -> xgr.CompiledGrammar:
    """`grammar` compiled by `compiler` (cached there); GrammarError if it does not compile."""
    try:
        if grammar.kind in ("json_schema", "json_object"):
            # json_object: any object, as vLLM (xgrammar's builtin JSON allows any value)
            spec = grammar.spec if grammar.kind == "json_schema" else JSON_OBJECT_SCHEMA
            return compiler.compile_json_schema(spec, any_whitespace=not grammar.compact)
        if grammar.kind == "regex":
            return compiler.compile_regex(grammar.spec)
        if grammar.kind == "ebnf":
            return compiler.compile_grammar(grammar.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"a {grammar.kind} grammar that does not compile: {e}") from e
    raise GrammarError(f"unknown grammar kind {grammar.kind!r}")


@dataclass
class TokenMask:
    """The allowed tokens of some rows of one step: `bitmask` row r (on the logits' device)
    for each r in `rows`; the other rows are untouched."""

    bitmask: torch.Tensor  # int32 [>= max(rows) + 1, ceil(vocab / 32)]
    rows: list[int]
    ext: object | None = None  # the CPU kernels (`subway_kernels/csrc/mask_cpu.cpp`), or None

    def apply(self, scores: torch.Tensor) -> None:
        """Disallowed tokens of `rows` to -inf, in place, in one call for the batch: our CPU
        kernel where it applies (30x xgrammar's on a JSON schema's mask), else xgrammar's."""
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
    ) -> None:
        """`ext`: the compiled CPU kernels, whose mask kernel then serves (`TokenMask`)."""
        self.tokenizer_path = tokenizer_path
        self.ext = ext
        self.max_rows = max_rows  # the bitmask's rows: sampled rows of a step, at most
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.seqs: dict[int, _Constrained] = {}
        self._pool: ThreadPoolExecutor | None = None
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
        """Start compiling a new sequence's grammar; it is joined when the sequence samples."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="subway-grammar")
        self.forget([seq_id])
        self.seqs[seq_id] = _Constrained(self._pool.submit(self._compile, grammar))

    def forget(self, seq_ids: list[int]) -> None:
        seqs = self.seqs
        for sid in seq_ids:
            state = seqs.pop(sid, None)
            if state is not None:
                state.compiled.cancel()

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
        """Join the compile threads and let go of xgrammar's objects now, in order, while
        the interpreter is whole (their C++ thread pools must not outlive it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.seqs.clear()
        self._batch = None
        self._compiler = None

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
        return GrammarStep(TokenMask(bitmask, rows, self.ext), states)

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

    def _compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        return compile_grammar(self.compiler(), grammar)

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
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=_COMPILER_THREADS, cache_enabled=True
                )
            return self._compiler
