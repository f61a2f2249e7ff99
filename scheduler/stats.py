"""The scheduler's statistics: one object, kept where each figure happens, read in one place.

`SchedulerStats` holds the counters; the planner, the settling of results and
the engine core each bump their own. `snapshot` turns them (with the queues
and the block manager) into the `EngineStats` that the frontend exports on
`/metrics`, and `log_line` into the periodic log line, so no figure is kept twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from subway.ipc.messages import EngineStats
from subway.scheduler.block_manager import BlockManager


@dataclass(slots=True)
class SchedulerStats:
    num_steps_planned: int = 0  # plans made (the next plan's step number)
    num_preempted_total: int = 0
    num_preempted_waiting: int = 0  # waiting after a preemption, now
    prefix_queries_total: int = 0  # tokens of admitted requests (prompt + output)
    prefix_hits_total: int = 0  # of which found in the prefix cache
    last_batch_size: int = 0
    last_num_batched_tokens: int = 0
    last_decode_kv: int = 0  # the context the last plan's decodes read
    last_num_decodes: int = 0  # the last plan's decode tokens (drafts included)
    last_schedule_time: float = 0.0
    schedule_time_total: float = 0.0
    # Set as results settle (the engine core times the steps; workers report the rest):
    num_steps_total: int = 0
    worker_busy_total: float = 0.0
    worker_idle_total: float = 0.0
    last_worker_idle_time: float = 0.0
    last_step_time: float = 0.0
    last_predicted_step_time: float = 0.0  # the cost model's figure for it, beforehand
    num_failed_total: int = 0  # sequences a failed step ended with "error"
    ipc_rejected_total: int = 0  # messages refused: the scheduler's and the workers' own
    num_displaced_total: int = 0  # running requests preempted for a waiting one (seat/blocks)
    slo_waits_total: int = 0  # steps a waiting chat let a batch request keep its seat (slack)
    chunk_capped_steps_total: int = 0  # steps whose batch prefill chunks the TPOT cap shrank
    pooling_limited_steps_total: int = 0  # steps whose pooled prompts --pooling-share held back
    spec_drafts_total: int = 0  # speculative decoding: steps of a request with a draft,
    spec_draft_tokens_total: int = 0  # the draft tokens they proposed,
    spec_accepted_tokens_total: int = 0  # and how many the worker accepted
    # Disaggregation (handoff.py): leases held and expired (prefill engines), KV copies in
    # (decode engines): blocks, failures, durations (count, sum, cumulative bucket counts).
    kv_leases: int = 0
    kv_leases_expired_total: int = 0
    kv_transfer_blocks_total: int = 0
    kv_transfer_failures_total: int = 0
    kv_transfer_count: int = 0
    kv_transfer_seconds_sum: float = 0.0
    kv_transfer_buckets: list[int] | None = None
    # Where the last log line left off, for per-interval rates:
    logged_steps: int = 0
    logged_schedule_time: float = 0.0

    def snapshot(
        self, num_running: int, num_waiting: int, num_queued: int, bm: BlockManager
    ) -> EngineStats:
        """`kv_blocks_used` counts blocks held by live requests; `kv_blocks_cached` counts
        cached blocks nobody holds, which are evictable and part of `kv_blocks_free`."""
        return EngineStats(
            step=self.num_steps_planned,
            num_running=num_running,
            num_waiting=num_waiting,
            num_queued=num_queued,
            num_preempted_total=self.num_preempted_total,
            batch_size=self.last_batch_size,
            num_batched_tokens=self.last_num_batched_tokens,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            kv_blocks_free=bm.num_free_blocks,
            prefix_cache_queries_total=self.prefix_queries_total,
            prefix_cache_hits_total=self.prefix_hits_total,
            scheduler_time=self.last_schedule_time,
            worker_idle_time=self.last_worker_idle_time,
            step_time=self.last_step_time,
            predicted_step_time=self.last_predicted_step_time,
            num_steps_total=self.num_steps_total,
            worker_busy_time_total=self.worker_busy_total,
            worker_idle_time_total=self.worker_idle_total,
            scheduler_time_total=self.schedule_time_total,
            ipc_rejected_total=self.ipc_rejected_total,
            num_displaced_total=self.num_displaced_total,
            slo_waits_total=self.slo_waits_total,
            chunk_capped_steps_total=self.chunk_capped_steps_total,
            pooling_limited_steps_total=self.pooling_limited_steps_total,
            spec_num_drafts_total=self.spec_drafts_total,
            spec_draft_tokens_total=self.spec_draft_tokens_total,
            spec_accepted_tokens_total=self.spec_accepted_tokens_total,
            kv_leases=self.kv_leases,
            kv_leases_expired_total=self.kv_leases_expired_total,
            kv_transfer_blocks_total=self.kv_transfer_blocks_total,
            kv_transfer_failures_total=self.kv_transfer_failures_total,
            kv_transfer_count=self.kv_transfer_count,
            kv_transfer_seconds_sum=self.kv_transfer_seconds_sum,
            kv_transfer_buckets=list(self.kv_transfer_buckets or ()),
        )

    def log_line(self, s: EngineStats, interval: float) -> str:
        """The periodic log line over the last `interval` seconds: queues, the last step,
        KV blocks, prefix cache, step rate; it starts the next interval."""
        steps = self.num_steps_planned - self.logged_steps
        sched_time = self.schedule_time_total - self.logged_schedule_time
        self.logged_steps = self.num_steps_planned
        self.logged_schedule_time = self.schedule_time_total
        queries = s.prefix_cache_queries_total
        hit = f"{100.0 * s.prefix_cache_hits_total / queries:.1f}%" if queries else "-"
        per_step = f"{1e6 * sched_time / steps:.0f}us" if steps else "-"
        return (
            f"running {s.num_running} waiting {s.num_waiting} "
            f"(preempted {self.num_preempted_waiting}, {s.num_preempted_total} total) | "
            f"last step: {s.batch_size} seqs {s.num_batched_tokens} tokens | "
            f"KV blocks used {s.kv_blocks_used} cached {s.kv_blocks_cached} "
            f"free {s.kv_blocks_free}/{s.kv_blocks_total} | prefix hit {hit} | "
            f"{steps / interval:.1f} steps/s, schedule {per_step}/step"
        )
