"""The model runner: a worker's model shard, its KV cache, its copy of every sequence, one step at a time."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from subway.ipc.config import EngineConfig, SchedulerConfig
from subway.ipc.messages import Plan, PromptLogprobs, SamplingParams, SeqStep, StepResult, TokenRef
from subway.ipc.shm import TokenBuffer, resolve
from subway.kernels import cpu_ext
from subway.kernels.attention import build_metadata, positions_and_slots
from subway.kernels.dispatch import choose_kernels
from subway.worker import kv_share
from subway.worker.cuda_graph import maybe_decode_graphs
from subway.worker.grammar import GrammarError, Grammars, GrammarStep
from subway.worker.huge_pages import rehome
from subway.worker.kv_cache import allocate_kv_cache, block_bytes, cuda_kv_budget
from subway.worker.layers import widen_bf16
from subway.worker.loader import load_weights
from subway.worker.model import CausalLM
from subway.worker.model_arch import load_model_arch, resolve_dtype
from subway.worker.parallel import TensorParallel
from subway.worker.prompt_logprobs import PromptLogprobTracker
from subway.worker.quant import int8_ops, unsupported_reason
from subway.worker.sampler import Sampler, SampleRequest, has_penalties
from subway.worker.smooth import smooth_for_int8
from subway.worker.speculative import draft_rows, verify


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


@dataclass
class StepOutput:
    """One entry per SeqStep that sampled, in plan order."""

    seq_ids: list[int]
    tokens: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # on first samples, when asked
    num_tokens: list[int] = field(default_factory=list)  # per sequence, after drafts

    def to_result(self, step: int, tokens: TokenRef | None = None) -> StepResult:
        """The StepResult of plan `step`; the sampled ids inline unless `tokens` names
        where they are (rank 0's shared buffer)."""
        return StepResult(
            step=step,
            seq_ids=self.seq_ids,
            tokens=tokens if tokens is not None else TokenRef(ids=self.tokens),
            logprobs=self.logprobs,
            top_ids=self.top_ids,
            top_logprobs=self.top_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            num_tokens=self.num_tokens,
        )


def logit_rows_worst_case(sched: SchedulerConfig, max_model_len: int) -> int:
    """Rows of logits one step can compute at most: a sampled row per sequence plus a
    prompt-logprob row per prefilled position, all within the step's token budget."""
    return min(sched.max_num_batched_tokens, max_model_len)


def resolve_device(name: str, rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.tp = TensorParallel(rank, world_size)
        if not config.model.path:
            raise ValueError("no model path: the launcher resolves the default model")
        self.path = config.model.path
        arch = load_model_arch(self.path)
        self.device = resolve_device(config.model.device, rank)
        self.dtype = resolve_dtype(config.model.dtype, arch.dtype, self.device)
        self.block_size = config.cache.block_size
        limit = arch.max_position_embeddings
        if arch.sliding_window:
            limit = min(limit, arch.sliding_window)  # no sliding-window attention: stay inside it
        self.max_model_len = config.model.max_model_len or limit
        self.vocab_size = arch.vocab_size
        self.eos_token_ids = list(arch.eos_token_ids)
        kernels = choose_kernels(config.model.kernels, config.model.cpu_ext, self.device)
        self.model = CausalLM(arch, self.tp, self.dtype, self.device, self.max_model_len, kernels)
        load_weights(self.model, self.path)
        self.model.eval()
        reason = unsupported_reason(config, self.device)
        if reason is not None:
            raise ValueError(reason)
        if config.model.quantization == "int8" and self.device.type == "cpu":
            tokenizer = config.model.tokenizer or self.path
            lm_head = smooth_for_int8(self.model, tokenizer, self.block_size)
            self.model.quantize_int8(int8_ops(), lm_head)
        elif config.model.quantization == "int8":  # a GPU: the lm_head stays as it is
            self.model.quantize_int8(None)
        if self.device.type == "cpu" and config.model.pack_weights:
            huge = config.model.huge_pages
            wide = widen_bf16(config.model.bf16_matmul)
            self.model.pack_weights(config.scheduler.max_num_seqs, huge, wide)  # layers.pack_weight
            if huge:
                rehome(self.model.one_row_weights())  # read whole at every small decode step
        attn = self.model.layers[0].self_attn.qkv
        self._kv_shape = (arch.num_layers, attn.num_kv_heads, arch.head_dim)
        self.num_blocks = self._count_blocks()
        self.kv_caches, self.kv_shared = kv_share.allocate(
            config.parallel.role, config.ipc.kv_source, rank, arch.num_layers,
            self.num_blocks, self.block_size, attn.num_kv_heads, arch.head_dim, self.dtype,
            self.device, config.model.huge_pages, config.cache.kv_cache_dtype == "int8",
        )  # fmt: skip
        self.sampler = Sampler(
            self.device, config.model.seed, self.eos_token_ids, kernels.argmax_rows
        )
        self.prompt_lps = PromptLogprobTracker()  # rank 0: SamplingParams.prompt_logprobs
        self.grammars = Grammars(  # rank 0: SamplingParams.grammar
            config.model.tokenizer or self.path, self.vocab_size, self.eos_token_ids,
            self.device, config.scheduler.max_num_seqs,
            cpu_ext.load() if self.device.type == "cpu" and config.model.cpu_ext else None,
            config.server.grammar_timeout,
        )  # fmt: skip
        self.graphs = maybe_decode_graphs(self)  # CUDA graphs of decode steps, or None
        self.seqs: dict[int, SeqState] = {}
        self.failed: set[int] = set()  # dropped after a failed step; the scheduler ends them
        self._prompts: TokenBuffer | None = None
        self._prompt_shm = config.ipc.prompt_shm_name  # until a plan names the frontend's

    # ------------------------------------------------------------------ setup

    def _count_blocks(self) -> int:
        if self.config.cache.num_kv_blocks > 0:
            return self.config.cache.num_kv_blocks
        layers, heads, head_dim = self._kv_shape
        kv_int8 = self.config.cache.kv_cache_dtype == "int8"
        per_block = block_bytes(layers, self.block_size, heads, head_dim, self.dtype, kv_int8)
        if self.device.type == "cuda":
            budget = cuda_kv_budget(
                self.config.cache.gpu_memory_utilization, self.device, self._profile_peak()
            )
        else:
            budget = self.config.cache.kv_cache_memory
        blocks = budget // per_block
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (budget {budget} bytes)")
        return int(blocks)

    @torch.inference_mode()
    def _profile_peak(self) -> int:
        """Peak CUDA bytes of one step of the largest batch, run on a scratch KV cache."""
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        rows = logit_rows_worst_case(self.config.scheduler, self.max_model_len)
        blocks = -(-n // self.block_size)
        layers, heads, head_dim = self._kv_shape
        torch.cuda.reset_peak_memory_stats(self.device)
        caches = allocate_kv_cache(
            layers, blocks, self.block_size, heads, head_dim, self.dtype, self.device,
            kv_int8=self.config.cache.kv_cache_dtype == "int8",
        )  # fmt: skip
        qlens, ctx = np.array([n]), np.array([n])
        table = np.arange(blocks, dtype=np.int32)[None, :]
        positions, slots = positions_and_slots(qlens, ctx, table, self.block_size)
        md = build_metadata(qlens, ctx, table, slots, self.block_size, self.device)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.from_numpy(positions).to(self.device)
        # Logits of every position: what prompt logprobs (echo + logprobs) can ask in one step.
        sample = torch.arange(n - rows, n, device=self.device)
        hidden = self.model(ids, pos, md, caches, sample)
        logits = self.model.compute_logits(hidden)
        # The sampler's worst case too: every row sorted for top-k/top-p, with logprobs.
        worst = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, logprobs=5)
        num_sampled = min(rows, self.config.scheduler.max_num_seqs)
        Sampler(self.device)(logits[:num_sampled], [SampleRequest(worst, 0, [0], 1)] * num_sampled)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        torch.cuda.empty_cache()
        return peak

    def _prompt_ids(self, ref: TokenRef) -> list[int]:
        """A new sequence's prompt: inline, or read from the frontend's buffer (attached on
        first use, and again whenever a plan names a new one). Checked against the vocabulary."""
        if ref.ids is not None:
            ids = list(ref.ids)
        else:
            if self._prompts is None:
                try:
                    self._prompts = TokenBuffer.attach(self._prompt_shm)
                except (OSError, ValueError) as e:
                    raise PlanError(f"cannot attach prompt buffer {self._prompt_shm}: {e}") from e
            try:
                ids = resolve(ref, self._prompts)
            except ValueError as e:
                raise PlanError(str(e)) from e
        if not ids or min(ids) < 0 or max(ids) >= self.vocab_size:
            raise PlanError(f"a prompt of {len(ids)} ids with one outside [0, {self.vocab_size})")
        return ids

    def _use_prompt_buffer(self, name: str) -> None:
        if name != self._prompt_shm:
            self._close_prompts()
            self._prompt_shm = name

    def _close_prompts(self) -> None:
        if self._prompts is not None:
            self._prompts.close()
            self._prompts = None

    def close(self) -> None:
        self._close_prompts()
        self.grammars.close()
        if self.kv_shared is not None:
            self.kv_shared.close()

    def drop(self, plan: Plan) -> list[int]:
        """After a failed step: forget every sequence the plan touched (their KV is suspect);
        the ids, which the scheduler ends with an error. Later steps for them are skipped
        until a plan lists them as finished."""
        ids = {s.seq_id for s in plan.seqs} | {s.seq_id for s in plan.new_seqs}
        for sid in ids:
            self.seqs.pop(sid, None)
        self.prompt_lps.forget(list(ids))
        self.grammars.forget(list(ids))
        self.failed |= ids
        return sorted(ids)

    def _grammar_step(self, seq_ids: list[int]) -> GrammarStep | None:
        """The grammar mask of this step's sampled rows (rank 0). A grammar that does not
        compile fails the step on every rank alike: rank 0 broadcasts -1 tokens, which
        the other ranks read as a PlanError, then raises its own."""
        try:
            return self.grammars.prepare(seq_ids)
        except GrammarError as e:
            failed = torch.full((len(seq_ids),), -1, dtype=torch.int64, device=self.device)
            self.tp.broadcast(failed)
            raise PlanError(str(e)) from e

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, plan: Plan) -> StepOutput:
        seqs = self.seqs
        if plan.prompt_shm:
            self._use_prompt_buffer(plan.prompt_shm)
        for sid in plan.finished:
            seqs.pop(sid, None)
        if self.failed:
            self.failed.difference_update(plan.finished)
        if self.prompt_lps.active:
            self.prompt_lps.forget(plan.finished)
        grammars = self.grammars
        if grammars.active:
            grammars.forget(plan.finished)
        for sid in plan.preempted:
            if sid in seqs:
                seqs[sid].block_table.clear()
        for ns in plan.new_seqs:
            ids = self._prompt_ids(ns.prompt)
            seqs[ns.seq_id] = SeqState(ids, len(ids), ns.sampling)
            if self.rank == 0 and ns.sampling.prompt_logprobs is not None:
                self.prompt_lps.add(ns.seq_id, ns.sampling, len(ids))
            if self.rank == 0 and ns.sampling.grammar is not None:
                grammars.add(ns.seq_id, ns.sampling.grammar)  # compiles while the step runs
            elif grammars.active:
                grammars.forget([ns.seq_id])  # a sequence id sent again, now unconstrained
        steps = plan.seqs
        if self.failed:  # steps planned before the scheduler saw the failure
            steps = [s for s in steps if s.seq_id not in self.failed]
        if not steps:
            return StepOutput([], [])

        n = len(steps)
        qlens = np.empty(n, dtype=np.int64)
        ctx = np.empty(n, dtype=np.int64)
        input_ids: list[int] = []
        states: list[SeqState] = []
        num_blocks = self.num_blocks
        drafted = False
        for i, step in enumerate(steps):
            st = seqs.get(step.seq_id)
            if st is None:
                raise PlanError(f"step {plan.step}: unknown seq {step.seq_id}")
            if step.new_blocks:
                if min(step.new_blocks) < 0 or max(step.new_blocks) >= num_blocks:
                    raise PlanError(f"step {plan.step}: a block id outside [0, {num_blocks})")
                st.block_table.extend(step.new_blocks)
            end = step.start_pos + step.num_tokens
            own = end  # positions fed from its own tokens; a draft's come after them
            if step.draft:
                self._check_draft(plan.step, step, st)
                own = end - len(step.draft)
                drafted = True
            if (
                step.start_pos < 0
                or own <= step.start_pos
                or own > len(st.tokens)
                or end > len(st.block_table) * self.block_size
            ):
                raise PlanError(
                    f"step {plan.step}: seq {step.seq_id} asks for positions up to {end} but the "
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
            ctx[i] = end
            states.append(st)
        tables = np.zeros((n, max(len(st.block_table) for st in states)), dtype=np.int32)
        for i, st in enumerate(states):
            tables[i, : len(st.block_table)] = st.block_table
        sampling = [i for i, step in enumerate(steps) if step.sample]
        dev = self.device
        graphs = self.graphs
        plp_idx, plp_slices = None, None  # prompt-logprob rows: rank 0, prefills that asked
        if self.rank == 0 and self.prompt_lps.active:
            plp_idx, plp_slices = self.prompt_lps.rows(steps, qlens)
        sampled_rows = sampling  # attention rows that sample (one per sequence, without drafts)
        ends = ctx  # per sequence: where its inputs end (`ctx` becomes per attention row)
        if drafted:  # a draft's positions as one-token rows (same tokens, same order)
            qlens, ctx, row_of = draft_rows([len(s.draft) for s in steps], qlens, ctx)
            tables = tables[row_of]
            sampled_rows = [r for r, i in enumerate(row_of.tolist()) if steps[i].sample]
        positions, slots = positions_and_slots(qlens, ctx, tables, self.block_size)
        if (
            graphs is not None
            and not plp_slices
            and graphs.fits(qlens, len(sampled_rows), tables.shape[1])
        ):
            logits = graphs.run(input_ids, positions, slots, ctx, tables)  # a decode step
        else:
            md = build_metadata(qlens, ctx, tables, slots, self.block_size, self.device)
            sample_idx = np.cumsum(qlens)[sampled_rows] - 1
            if plp_slices:
                sample_idx = np.concatenate([sample_idx, plp_idx])
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.from_numpy(positions).to(dev),
                md,
                self.kv_caches,
                torch.from_numpy(sample_idx).to(dev),
            )
            if plp_slices:
                num_rows = len(sample_idx) - len(plp_idx)
                extra = self.model.compute_logits(hidden[num_rows:])
                self.prompt_lps.record(extra, plp_slices, lambda sid: seqs[sid].tokens)
                hidden = hidden[:num_rows]
            if not sampling:
                return StepOutput([], [])
            logits = None

        out = None
        constrained: GrammarStep | None = None
        seq_ids = [steps[i].seq_id for i in sampling]
        if self.rank == 0:
            rows = []
            for i in sampling:
                st = states[i]
                generated = int(ends[i]) - st.prompt_len
                draft = steps[i].draft
                if not draft:
                    rows.append(SampleRequest(st.sampling, generated, st.tokens, st.prompt_len))
                    continue
                generated -= len(draft)
                penalised = has_penalties(st.sampling)
                for j in range(len(draft) + 1):
                    seen = st.tokens + draft[:j] if penalised and j else st.tokens
                    rows.append(SampleRequest(st.sampling, generated + j, seen, st.prompt_len))
            if logits is None:
                logits = self.model.compute_logits(hidden)
            if grammars.active:  # filled on the host while the device computes the logits
                row_seqs = (
                    seq_ids
                    if not drafted
                    else [  # each sampled row's sequence
                        steps[i].seq_id for i in sampling for _ in range(1 + len(steps[i].draft))
                    ]
                )
                constrained = self._grammar_step(row_seqs)
            out = self.sampler(logits, rows, constrained.mask if constrained else None)
            token_tensor = out.tokens
        else:
            token_tensor = torch.empty(len(sampled_rows), dtype=torch.int64, device=dev)
        tokens = self.tp.broadcast(token_tensor.to(torch.int64)).tolist()
        if self.rank != 0 and tokens and min(tokens) < 0:
            raise PlanError(f"step {plan.step}: failed on rank 0 (a grammar)")
        if constrained is not None:
            constrained.accept(tokens)  # constrained rows carry no draft: one row each

        result = StepOutput(seq_ids, tokens)
        kept = None
        if drafted:  # every rank alike: the same sampled rows, the same drafts
            tokens, result.num_tokens, kept = verify(tokens, [steps[i].draft for i in sampling])
            result.tokens = tokens
            at = 0
            for i, c in zip(sampling, result.num_tokens, strict=True):
                states[i].tokens += tokens[at : at + c]
                at += c
        else:
            for i, tok in zip(sampling, tokens, strict=True):
                states[i].tokens.append(tok)
        if out is not None:
            result.logprobs, result.top_ids, result.top_logprobs = (
                out.logprobs, out.top_ids, out.top_logprobs,
            )  # fmt: skip
            if kept is not None and out.logprobs is not None:
                result.logprobs = [out.logprobs[r] for r in kept]
                result.top_ids = [out.top_ids[r] for r in kept]
                result.top_logprobs = [out.top_logprobs[r] for r in kept]
            if self.prompt_lps.active:
                result.prompt_logprobs = self.prompt_lps.emit(result.seq_ids)
        return result

    def _check_draft(self, step_no: int, step: SeqStep, st: SeqState) -> None:
        """A draft rides only on a sampled decode, after its one token of its own, within
        the vocabulary, and never for a constrained sequence (on every rank alike)."""
        d = step.draft
        if (
            not step.sample
            or len(d) != step.num_tokens - 1  # a decode: one token of its own
            or min(d) < 0
            or max(d) >= self.vocab_size
            or st.sampling.grammar is not None
        ):
            raise PlanError(f"step {step_no}: seq {step.seq_id} has a draft it cannot verify")
