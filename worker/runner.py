"""The model runner: a worker's model shard, its KV cache, its copy of every sequence, one step at a time.

A step (`execute`) runs in five stages: apply the plan's bookkeeping, build the batch
(`batch.py`), the forward pass (a decode step's CUDA graph, or eager), sampling (rank 0,
broadcast to the others), then commit: verify drafts, append the tokens, advance grammars.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from subway.ipc.config import EngineConfig
from subway.ipc.messages import Plan, PromptLogprobs, SeqStep, StepResult, TokenRef
from subway.ipc.shm import TokenBuffer, resolve
from subway.kernels import cpu_ext
from subway.kernels.dispatch import choose_kernels
from subway.worker import kv_share
from subway.worker.batch import Batch, PlanError, SeqState, build_batch
from subway.worker.cuda_graph import maybe_decode_graphs
from subway.worker.families import build_model, resolve_device
from subway.worker.grammar import GrammarError, Grammars, GrammarStep
from subway.worker.huge_pages import rehome
from subway.worker.kv_pages import count_pages, kv_pages_for
from subway.worker.layers import widen_bf16
from subway.worker.loader import load_weights
from subway.worker.lora import check_loras, lora_manager, prepare_loras
from subway.worker.model import CausalLM, layer_windows, max_model_len
from subway.worker.model_arch import load_model_arch, resolve_dtype
from subway.worker.parallel import TensorParallel
from subway.worker.pooling import PoolingTracker
from subway.worker.prompt_logprobs import PromptLogprobTracker
from subway.worker.quant import int8_ops, unsupported_reason
from subway.worker.sampler import Sampler, SampleRequest, SamplerOutput, has_penalties
from subway.worker.smooth import smooth_for_int8
from subway.worker.speculative import verify


@dataclass
class StepOutput:
    """One entry per SeqStep that sampled, in plan order."""

    seq_ids: list[int]
    tokens: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # on first samples, when asked
    embeddings: list[bytes | None] | None = None  # on first samples, when pooled
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
            embeddings=self.embeddings,
            num_tokens=self.num_tokens,
        )


def prepare_weights(model: CausalLM, config: EngineConfig, device: torch.device) -> None:
    """The loaded weights made ready for `device`, before the KV cache is sized: int8 (on
    the CPU after SmoothQuant's calibration), packed into the CPU kernels' layout, and the
    weights every small decode step reads whole moved onto huge pages."""
    reason = unsupported_reason(config, device)
    if reason is not None:
        raise ValueError(reason)
    if config.model.quantization == "int8" and device.type == "cpu":
        tokenizer = config.model.tokenizer or config.model.path
        lm_head = smooth_for_int8(model, tokenizer, config.cache.block_size)
        model.quantize_int8(int8_ops(), lm_head)
    elif config.model.quantization == "int8":  # a GPU: the lm_head stays as it is
        model.quantize_int8(None)
    if device.type == "cpu" and config.model.pack_weights:
        huge = config.model.huge_pages
        wide = widen_bf16(config.model.bf16_matmul)
        model.pack_weights(config.scheduler.max_num_seqs, huge, wide)  # layers.pack_weight
        if huge:
            rehome(model.one_row_weights())  # read whole at every small decode step


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
        kernels = choose_kernels(config.model.kernels, config.model.cpu_ext, self.device)
        limit = config.model.max_model_len or arch.max_position_embeddings
        # Sliding windows run on the CPU; under Triton (CUDA), which has none, every sequence
        # stays inside the model's window (`model.max_model_len`).
        self.max_model_len = max_model_len(arch, kernels, limit)
        self.vocab_size = arch.vocab_size
        self.eos_token_ids = list(arch.eos_token_ids)
        model = (arch, self.tp, self.dtype, self.device, self.max_model_len, kernels)
        self.model = build_model(*model)
        load_weights(self.model, self.path)
        self.model.eval()
        prepare_weights(self.model, config, self.device)
        attn = self.model.layers[0].self_attn.qkv
        self.kv_shape = (arch.num_layers, attn.num_kv_heads, arch.head_dim)
        windows = layer_windows(arch, kernels)
        self.pages = kv_pages_for(config, self.device, windows, self.max_model_len)
        self.num_blocks = count_pages(self)  # pages of `pages.groups.page_layers` layers
        slots, self.kv_shared = kv_share.allocate(
            config.parallel.role, config.ipc.kv_source, rank, self.pages.groups.page_layers,
            self.num_blocks, self.block_size, attn.num_kv_heads, arch.head_dim, self.dtype,
            self.device, config.model.huge_pages, config.cache.kv_cache_dtype == "int8",
        )  # fmt: skip
        self.kv_caches = self.pages.layer_caches(slots)
        self.sampler = Sampler(
            self.device, config.model.seed, self.eos_token_ids, kernels.argmax_rows
        )
        self.prompt_lps = PromptLogprobTracker()  # rank 0: SamplingParams.prompt_logprobs
        self.pooling = PoolingTracker()  # rank 0: SamplingParams.pooling
        self.grammars = Grammars(  # rank 0: SamplingParams.grammar
            config.model.tokenizer or self.path, self.vocab_size, self.eos_token_ids,
            self.device, config.scheduler.max_num_seqs,
            cpu_ext.load() if self.device.type == "cpu" and config.model.cpu_ext else None,
            config.server.grammar_timeout,
        )  # fmt: skip
        # With --enable-lora: adapter slots on every linear, before the KV cache is sized.
        self.lora = lora_manager(config, self.model)
        self.graphs = maybe_decode_graphs(self)  # CUDA graphs of decode steps, or None
        self.seqs: dict[int, SeqState] = {}
        self.failed: set[int] = set()  # dropped after a failed step; the scheduler ends them
        self._prompts: TokenBuffer | None = None
        self._prompt_shm = config.ipc.prompt_shm_name  # until a plan names the frontend's

    # ------------------------------------------------------------------ setup

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
        """Run one plan; the sampled tokens are in every rank's copy of their sequences."""
        steps = self._apply_plan(plan)
        if not steps:
            return StepOutput([], [])
        batch = self._build_batch(plan.step, steps)
        if self.lora is not None:
            prepare_loras(self.lora, batch)
        logits, hidden = self._forward(batch)
        if not batch.sampling:
            return StepOutput([], [])
        out, constrained, tokens = self._sample(plan.step, batch, logits, hidden)
        return self._commit(batch, out, constrained, tokens)

    def _apply_plan(self, plan: Plan) -> list[SeqStep]:
        """The plan's bookkeeping (its prompt buffer; finished, preempted and new sequences);
        the steps to run: the plan's, less those of sequences a failed step dropped."""
        seqs = self.seqs
        if plan.prompt_shm:
            self._use_prompt_buffer(plan.prompt_shm)
        for sid in plan.finished:
            seqs.pop(sid, None)
        if self.failed:
            self.failed.difference_update(plan.finished)
        if self.prompt_lps.active:
            self.prompt_lps.forget(plan.finished)
        if self.pooling.active:
            self.pooling.forget(plan.finished)
        grammars = self.grammars
        if grammars.active:
            grammars.forget(plan.finished)
        for sid in plan.preempted:
            if sid in seqs:
                seqs[sid].block_table.clear()
        check_loras(self.lora, plan)
        for ns in plan.new_seqs:
            ids = self._prompt_ids(ns.prompt)
            seqs[ns.seq_id] = SeqState(ids, len(ids), ns.sampling, lora=ns.lora)
            if self.rank == 0 and ns.sampling.prompt_logprobs is not None:
                self.prompt_lps.add(ns.seq_id, ns.sampling, len(ids))
            if self.rank == 0 and ns.sampling.pooling:
                self.pooling.add(ns.seq_id, ns.sampling, len(ids))
            if self.rank == 0 and ns.sampling.grammar is not None:
                grammars.add(ns.seq_id, ns.sampling.grammar)  # compiles while the step runs
            elif grammars.active:
                grammars.forget([ns.seq_id])  # a sequence id sent again, now unconstrained
        steps = plan.seqs
        if self.failed:  # steps planned before the scheduler saw the failure
            steps = [s for s in steps if s.seq_id not in self.failed]
        return steps

    def _build_batch(self, step_no: int, steps: list[SeqStep]) -> Batch:
        """The steps as a batch; prompt-logprob rows on rank 0, where some prefill asked."""
        prompt_lps = self.prompt_lps if self.rank == 0 and self.prompt_lps.active else None
        pooling = self.pooling if self.rank == 0 and self.pooling.active else None
        return build_batch(
            step_no, steps, self.seqs, self.num_blocks, self.block_size, self.vocab_size,
            self.grammars, prompt_lps, pooling, self.pages.num_groups, self.pages.slides,
        )  # fmt: skip

    def _forward(self, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, None) of a decode step's CUDA graph, or eagerly (None, the sampled rows'
        hidden states), the prompt-logprob rows' logits recorded on the way."""
        graphs = self.graphs
        qlens, ctx, tables = batch.qlens, batch.ctx, batch.tables
        if (
            graphs is not None
            and not batch.extra_rows
            and (self.lora is None or not self.lora.step.active)
            and graphs.fits(qlens, len(batch.sampled_rows), tables.shape[1])
        ):
            return graphs.run(batch.input_ids, batch.positions, batch.slots, ctx, tables), None
        dev = self.device
        plp_idx, plp_slices = batch.plp_idx, batch.plp_slices
        md = self.pages.metadata(qlens, ctx, tables, batch.slots, self.block_size, dev)
        sample_idx = np.cumsum(qlens)[batch.sampled_rows] - 1
        num_rows = len(sample_idx)
        if batch.extra_rows:
            extra = [x for x in (plp_idx, batch.pool_idx) if x is not None and len(x)]
            sample_idx = np.concatenate([sample_idx, *extra])
        hidden = self.model(
            torch.tensor(batch.input_ids, dtype=torch.int64, device=dev),
            torch.from_numpy(batch.positions).to(dev),
            md,
            self.kv_caches,
            torch.from_numpy(sample_idx).to(dev),
        )
        if batch.extra_rows:
            at = num_rows
            if plp_slices:
                extra = self.model.compute_logits(hidden[at : at + len(plp_idx)])
                seqs = self.seqs
                self.prompt_lps.record(extra, plp_slices, lambda sid: seqs[sid].tokens)
                at += len(plp_idx)
            if batch.pool_slices:
                self.pooling.record(hidden[at:], batch.pool_slices)
            hidden = hidden[:num_rows]
        return None, hidden

    def _sample(
        self,
        step_no: int,
        batch: Batch,
        logits: torch.Tensor | None,
        hidden: torch.Tensor | None,
    ) -> tuple[SamplerOutput | None, GrammarStep | None, list[int]]:
        """The tokens of the sampled rows, in row order: rank 0 samples them (under its
        grammars' masks) and broadcasts them; the other ranks receive them."""
        out = None
        constrained: GrammarStep | None = None
        if self.rank == 0:
            rows = self._sample_requests(batch)
            if logits is None:
                logits = self.model.compute_logits(hidden)
            if self.grammars.active:  # filled on the host while the device computes the logits
                constrained = self._grammar_step(batch.row_seq_ids())
            out = self.sampler(logits, rows, constrained.mask if constrained else None)
            token_tensor = out.tokens
        else:
            token_tensor = torch.empty(
                len(batch.sampled_rows), dtype=torch.int64, device=self.device
            )
        tokens = self.tp.broadcast(token_tensor.to(torch.int64)).tolist()
        if self.rank != 0 and tokens and min(tokens) < 0:
            raise PlanError(f"step {step_no}: failed on rank 0 (a grammar)")
        return out, constrained, tokens

    def _sample_requests(self, batch: Batch) -> list[SampleRequest]:
        """A SampleRequest per sampled row: a drafted sequence's rows count the draft tokens
        before them as generated (and, for penalties, as seen)."""
        steps, states, ends = batch.steps, batch.states, batch.ends
        rows: list[SampleRequest] = []
        for i in batch.sampling:
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
        return rows

    def _commit(
        self,
        batch: Batch,
        out: SamplerOutput | None,
        constrained: GrammarStep | None,
        tokens: list[int],
    ) -> StepOutput:
        """Advance the grammars, keep each draft's verified tokens, append the tokens to their
        sequences (every rank alike), and (rank 0) the logprobs of the tokens kept."""
        if constrained is not None:
            constrained.accept(tokens)  # constrained rows carry no draft: one row each
        sampling, states = batch.sampling, batch.states
        result = StepOutput(batch.seq_ids, tokens)
        kept = None
        if batch.drafted:  # every rank alike: the same sampled rows, the same drafts
            steps = batch.steps
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
            if self.pooling.active:
                result.embeddings = self.pooling.emit(result.seq_ids)
        return result
