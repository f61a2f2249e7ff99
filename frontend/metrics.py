"""Prometheus metrics, named like vLLM's with a `subway:` prefix so dashboards adapt by a rename.

Engine-wide gauges come from the scheduler's `EngineStats`; per-request
latencies are observed here, in the frontend, where a client sees them. Each
app gets its own registry: no global state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from subway.ipc.messages import EngineStats

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"subway:{name}", doc, label, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"subway:{name}", doc, label + list(extra), registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"subway:{name}", doc, label, buckets=LATENCY_BUCKETS, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks held by live requests (0-1)."
        )
        self.batch_size = gauge("batch_size", "Sequences in the last step.")
        self.kv_blocks_free = gauge("kv_blocks_free", "KV blocks free (cached ones included).")
        self.scheduler_time = gauge(
            "scheduler_last_step_seconds", "Scheduler time for the last plan."
        )
        self.worker_idle = gauge("worker_idle_last_step_seconds", "Worker wait for the last plan.")
        self.preemptions = counter("num_preemptions", "Preemptions by recompute.")
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache."
        )
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.steps = counter("num_steps", "Model steps run.")
        self.worker_busy = counter("worker_busy_seconds", "Seconds rank 0 spent running steps.")
        self.worker_idle_total = counter(
            "worker_idle_seconds", "Seconds rank 0 waited for a plan between steps."
        )
        self.scheduler_busy = counter("scheduler_seconds", "Seconds the scheduler spent planning.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to the first scheduled step."
        )
        for metric in (
            self.running, self.waiting, self.kv_usage, self.batch_size, self.kv_blocks_free,
            self.scheduler_time, self.worker_idle, self.preemptions, self.prefix_hits,
            self.prefix_queries, self.prompt_tokens, self.generation_tokens,
            self.ttft, self.itl, self.e2e, self.queue_time, self.steps, self.worker_busy,
            self.worker_idle_total, self.scheduler_busy,
        ):  # fmt: skip
            metric.labels(model_name)  # every series exists from the start, at 0
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        # Engine totals arrive as running totals; counters take the increase.
        self._seen_preemptions = 0
        self._seen_hits = 0
        self._seen_queries = 0
        self._seen_steps = 0
        self._seen_busy = 0.0
        self._seen_idle = 0.0
        self._seen_sched = 0.0

    def observe_stats(self, s: EngineStats) -> None:
        m = self.model_name
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        total = max(1, s.kv_blocks_total)
        self.kv_usage.labels(m).set(s.kv_blocks_used / total)
        self.kv_blocks_free.labels(m).set(s.kv_blocks_free)
        self.batch_size.labels(m).set(s.batch_size)
        self.scheduler_time.labels(m).set(s.scheduler_time)
        self.worker_idle.labels(m).set(s.worker_idle_time)
        for total_now, attr, counter in (
            (s.num_preempted_total, "_seen_preemptions", self.preemptions),
            (s.prefix_cache_hits_total, "_seen_hits", self.prefix_hits),
            (s.prefix_cache_queries_total, "_seen_queries", self.prefix_queries),
            (s.num_steps_total, "_seen_steps", self.steps),
            (s.worker_busy_time_total, "_seen_busy", self.worker_busy),
            (s.worker_idle_time_total, "_seen_idle", self.worker_idle_total),
            (s.scheduler_time_total, "_seen_sched", self.scheduler_busy),
        ):
            seen = getattr(self, attr)
            if total_now > seen:
                counter.labels(m).inc(total_now - seen)
                setattr(self, attr, total_now)

    def observe_first_token(self, ttft: float, queue_time: float | None = None) -> None:
        m = self.model_name
        self.generation_tokens.labels(m).inc()
        self.ttft.labels(m).observe(max(0.0, ttft))
        if queue_time is not None:
            self.queue_time.labels(m).observe(max(0.0, queue_time))

    def observe_inter_token(self, seconds: float) -> None:
        m = self.model_name
        self.generation_tokens.labels(m).inc()
        self.itl.labels(m).observe(max(0.0, seconds))

    def observe_finish(
        self, prompt_tokens: int, output_tokens: int, e2e: float, finish_reason: str
    ) -> None:
        """One engine request ended, however it ended (finish_reason "abort" when cut)."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.success.labels(m, finish_reason).inc()
        self.e2e.labels(m).observe(max(0.0, e2e))

    def render(self) -> bytes:
        return generate_latest(self.registry)
