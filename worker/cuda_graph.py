"""CUDA graphs for decode steps: one graph per common batch size, batches padded up to it.

A decode step of `n` sequences (one token each, all sampling) replays the graph
of the smallest captured size `b >= n`. Every input lives in a static buffer
that the graph reads: token ids, positions, slots, context lengths (one host
copy of a `[4, b]` staging tensor) and the block tables (one copy of `n` rows).
Padded rows `n..b` have context length 1, position 0 and slot -1, so they write
no KV (the Triton `write_kv` skips negative slots) and read one valid cached
key; their logits are never sampled. Every graph ends by copying its logits,
the sampler's input, into one static buffer.

Graphs need the Triton kernels (the reference attention plans on the host from
per-step lengths), one rank (no collectives captured), and are off with
`enforce_eager`. `capture=False` runs the same static-buffer path eagerly, so
that the padding logic is testable on the CPU under Triton's interpreter.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from subway.kernels.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to (and including) `max_num_seqs`."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def maybe_decode_graphs(runner) -> DecodeGraphs | None:
    """The runner's decode graphs, or None where they do not apply (see the module doc)."""
    config = runner.config
    if (
        runner.device.type != "cuda"
        or config.model.enforce_eager
        or runner.tp.world_size > 1
        or runner.model.kernels.name != "triton"
    ):
        return None
    return DecodeGraphs(runner, capture_sizes(config.scheduler.max_num_seqs), capture=True)


class DecodeGraphs:
    def __init__(self, runner, sizes: list[int], capture: bool = True) -> None:
        if runner.model.kernels.name != "triton":
            raise RuntimeError(
                "decode graphs need the Triton kernels (--kernels triton, or auto on CUDA)"
            )
        self.model = runner.model
        self.kv_caches = runner.kv_caches
        self.device = runner.device
        self.sizes = sorted(sizes)
        self.capture = capture
        self.replays = 0
        b = self.sizes[-1]
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        pin = self.device.type == "cuda"
        # rows: token ids, positions, slots, context lengths
        self._stage = torch.zeros(4, b, dtype=torch.int64, pin_memory=pin)
        self._stage_tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self._io = torch.zeros(4, b, dtype=torch.int64, device=self.device)
        self._tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=self.device)
        self._qsl = torch.arange(b + 1, dtype=torch.int32, device=self.device)
        self._arange = torch.arange(b, dtype=torch.int64, device=self.device)
        self._pad(0, b)
        self._io.copy_(self._stage)
        self._copied = torch.cuda.Event() if pin else None  # the staging is free again
        self._md = {n: self._metadata(n) for n in self.sizes}
        vocab = runner.model.arch.vocab_size
        self._logits = torch.empty(b, vocab, dtype=runner.dtype, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture()

    def _metadata(self, n: int) -> AttentionMetadata:
        """Views of the static buffers; the reference-only fields are placeholders."""
        return AttentionMetadata(
            slot_mapping=self._io[2, :n],
            query_start_loc=self._qsl[: n + 1],
            context_lens=self._io[3, :n],
            block_tables=self._tables[:n],
            decode_seqs=self._arange[:n],
            decode_tokens=self._arange[:n],
            decode_max_blocks=self.max_blocks,
            decode_pad=torch.zeros(n, 0, dtype=torch.bool, device=self.device),
            prefills=[],
            prefill_masks=[],
            all_decode=True,
        )

    def _forward(self, n: int) -> None:
        """The model on the first `n` rows of the static inputs; logits into the static output."""
        hidden = self.model(
            self._io[0, :n], self._io[1, :n], self._md[n], self.kv_caches, self._arange[:n]
        )
        self._logits[:n].copy_(self.model.compute_logits(hidden))

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for n in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            self._forward(n)  # compiles the kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(n)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)

    def _pad(self, n: int, b: int) -> None:
        stage = self._stage.numpy()
        stage[0, n:b] = 0
        stage[1, n:b] = 0
        stage[2, n:b] = -1
        stage[3, n:b] = 1

    def fits(self, qlens: np.ndarray, num_sampled: int, table_width: int) -> bool:
        """Whether this step is a graph's: all decodes, all sampling, a captured size or less."""
        n = len(qlens)
        return (
            n <= self.sizes[-1]
            and num_sampled == n
            and table_width <= self.max_blocks
            and bool((qlens == 1).all())
        )

    def run(
        self,
        input_ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """Logits `[n, vocab]` of a decode step (a view of a static buffer: use before the next run)."""
        n = len(input_ids)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the staging
        stage = self._stage.numpy()
        stage[0, :n] = input_ids
        stage[1, :n] = positions
        stage[2, :n] = slots
        stage[3, :n] = context_lens
        self._pad(n, b)
        w = block_tables.shape[1]
        self._stage_tables.numpy()[:n, :w] = block_tables
        self._io.copy_(self._stage, non_blocking=True)
        self._tables[:n].copy_(self._stage_tables[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.capture:
            self.graphs[b].replay()
        else:
            self._forward(b)
        self.replays += 1
        return self._logits[:n]
