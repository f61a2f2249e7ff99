"""A worker's KV pages: how many, the caches that hold them, and each layer's view.

With hybrid KV groups (`ipc/kv_groups.py`) a page holds `page_layers` layers' slots of one
block; the worker keeps `page_layers` caches of `[pages, block_size, heads, dim]` and layer
`l` uses cache `layer_slot[l]` through its group's block tables. A sequence's table is
flat, `table[j * num_groups + k]` (the scheduler's order); each step gets one
`AttentionMetadata` per group, and each layer reads its own group's (`per_layer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from subway.ipc.config import EngineConfig, SchedulerConfig
from subway.ipc.kv_groups import KVGroups, plan_groups, single_group
from subway.ipc.messages import SamplingParams
from subway.kernels.attention import (
    AttentionMetadata,
    build_metadata,
    positions_and_slots,
    with_tables,
)
from subway.worker.kv_cache import allocate_kv_cache, block_bytes, cuda_kv_budget
from subway.worker.model import KVCache
from subway.worker.sampler import Sampler, SampleRequest

if TYPE_CHECKING:
    from subway.worker.runner import ModelRunner


def logit_rows_worst_case(sched: SchedulerConfig, max_model_len: int) -> int:
    """Rows of logits one step can compute at most: a sampled row per sequence plus a
    prompt-logprob row per prefilled position, all within the step's token budget."""
    return min(sched.max_num_batched_tokens, max_model_len)


class KVPages:
    def __init__(self, groups: KVGroups, layer_windows: list[int]) -> None:
        self.groups = groups
        self.num_groups = groups.num_groups
        self.slides = any(groups.windows)  # the scheduler releases pages behind windows
        # Per group: the windows its layers slide by (`build_metadata`'s `windows`). A layer
        # whose window no sequence outgrows sits in a global group but still slides.
        pairs = list(zip(layer_windows, groups.layer_group, strict=True))
        self.group_windows = [
            tuple(sorted({w for w, g in pairs if g == k and w})) for k in range(self.num_groups)
        ]

    @property
    def reported_windows(self) -> list[int]:
        """`WorkerReady.kv_windows`: the groups' windows (empty: one global group)."""
        g = self.groups
        return [] if g.num_groups == 1 and not g.windows[0] else list(g.windows)

    def layer_caches(self, slots: list[KVCache]) -> list[KVCache]:
        """Each layer's caches out of the `page_layers` slot caches."""
        return [slots[s] for s in self.groups.layer_slot]

    def metadata(
        self,
        qlens: np.ndarray,
        ctx: np.ndarray,
        tables: np.ndarray,
        slots: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """The step's metadata: group 0's, with every layer's own in `per_layer` when there
        are several groups. `tables` are flat, `slots` group 0's (`build_batch`)."""
        G = self.num_groups
        if G == 1:
            return build_metadata(qlens, ctx, tables, slots, block_size, device,
                                  self.group_windows[0])  # fmt: skip
        mds: list[AttentionMetadata] = []
        built: dict[tuple[int, ...], AttentionMetadata] = {}  # one build per set of windows
        for k in range(G):
            t = np.ascontiguousarray(tables[:, k::G])
            s = slots if k == 0 else positions_and_slots(qlens, ctx, t, block_size)[1]
            windows = self.group_windows[k]
            like = built.get(windows)
            if like is None:
                like = built[windows] = build_metadata(
                    qlens, ctx, t, s, block_size, device, windows
                )
                mds.append(like)
            else:  # only the tables and slots differ
                mds.append(with_tables(like, t, s))
        md = mds[0]
        md.per_layer = [mds[g] for g in self.groups.layer_group]
        return md


def kv_pages_for(
    config: EngineConfig, device: torch.device, layer_windows: list[int], max_model_len: int
) -> KVPages:
    """Hybrid groups where they save memory and are supported: sliding layers, the CPU's
    kernels, an engine that neither sends nor takes KV blocks (disaggregation copies one
    page layout), and `--disable-hybrid-kv-cache` not given."""
    hybrid = (
        device.type == "cpu" and config.parallel.role == "both" and config.cache.hybrid_kv_cache
    )
    n = len(layer_windows)
    groups = plan_groups(layer_windows, max_model_len) if hybrid else single_group(n)
    return KVPages(groups, layer_windows)


def count_pages(runner: ModelRunner) -> int:
    """KV pages the budget holds: the memory of `--num-kv-blocks` blocks of every layer, or
    the memory budget (`--kv-cache-memory` on the CPU; what a profiled step leaves of the
    GPU), over a page's bytes."""
    cache = runner.config.cache
    num_layers, heads, head_dim = runner.kv_shape
    layers = runner.pages.groups.page_layers
    if cache.num_kv_blocks > 0:
        return cache.num_kv_blocks * (num_layers // layers)
    kv_int8 = cache.kv_cache_dtype == "int8"
    per_page = block_bytes(layers, runner.block_size, heads, head_dim, runner.dtype, kv_int8)
    if runner.device.type == "cuda":
        budget = cuda_kv_budget(cache.gpu_memory_utilization, runner.device, profile_peak(runner))
    else:
        budget = cache.kv_cache_memory
    pages = budget // per_page
    if pages < 1:
        raise RuntimeError(f"no memory left for the KV cache (budget {budget} bytes)")
    return int(pages)


@torch.inference_mode()
def profile_peak(runner: ModelRunner) -> int:
    """Peak CUDA bytes of one step of the largest batch, run on a scratch KV cache (one
    group: hybrid groups are CPU-only)."""
    config, dev, bs = runner.config, runner.device, runner.block_size
    n = min(config.scheduler.max_num_batched_tokens, runner.max_model_len)
    rows = logit_rows_worst_case(config.scheduler, runner.max_model_len)
    blocks = -(-n // bs)
    layers, heads, head_dim = runner.kv_shape
    torch.cuda.reset_peak_memory_stats(dev)
    caches = allocate_kv_cache(
        layers, blocks, bs, heads, head_dim, runner.dtype, dev,
        kv_int8=config.cache.kv_cache_dtype == "int8",
    )  # fmt: skip
    qlens, ctx = np.array([n]), np.array([n])
    table = np.arange(blocks, dtype=np.int32)[None, :]
    positions, slots = positions_and_slots(qlens, ctx, table, bs)
    md = build_metadata(qlens, ctx, table, slots, bs, dev, runner.model.windows)
    ids = torch.zeros(n, dtype=torch.int64, device=dev)
    pos = torch.from_numpy(positions).to(dev)
    # Logits of every position: what prompt logprobs (echo + logprobs) can ask in one step.
    sample = torch.arange(n - rows, n, device=dev)
    hidden = runner.model(ids, pos, md, caches, sample)
    logits = runner.model.compute_logits(hidden)
    # The sampler's worst case too: every row sorted for top-k/top-p, with logprobs.
    worst = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, logprobs=5)
    num_sampled = min(rows, config.scheduler.max_num_seqs)
    Sampler(dev)(logits[:num_sampled], [SampleRequest(worst, 0, [0], 1)] * num_sampled)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del caches, hidden
    torch.cuda.empty_cache()
    return peak
