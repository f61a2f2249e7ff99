"""Prometheus metrics, named like vLLM's with a `subway:` prefix so dashboards adapt by a rename.

Engine-wide figures are read at scrape time from the latest `EngineStats` the
scheduler sent (`observe_stats`), gauges and running totals alike: the
scheduler's `SchedulerStats` is the one place they are kept. Per-request
latencies and token counts are observed here, in the frontend, where a client
sees them. Each app gets its own registry: no global state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from subway.frontend.router import Route
from subway.ipc.messages import KV_TRANSFER_BUCKETS, EngineStats

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip

GRAMMAR_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# (name, help, value): the engine's gauges and counters, straight from its EngineStats.
ENGINE_GAUGES: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    ("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    ("kv_cache_usage_perc", "Fraction of KV blocks held by live requests (0-1).",
     lambda s: s.kv_blocks_used / max(1, s.kv_blocks_total)),
    ("batch_size", "Sequences in the last step.", lambda s: s.batch_size),
    ("kv_blocks_free", "KV blocks free (cached ones included).", lambda s: s.kv_blocks_free),
    ("scheduler_last_step_seconds", "Scheduler time for the last plan.",
     lambda s: s.scheduler_time),
    ("worker_idle_last_step_seconds", "Worker wait for the last plan.",
     lambda s: s.worker_idle_time),
    ("step_last_seconds", "The last settled step's time, plan sent to result.",
     lambda s: s.step_time),
    ("step_predicted_last_seconds", "The step cost model's prediction for that step, made "
     "before it ran (scheduler/slo.py).", lambda s: s.predicted_step_time),
    ("kv_leases", "Disaggregation: leases a prefill engine holds now.", lambda s: s.kv_leases),
    ("lora_memory_bytes", "LoRA: bytes rank 0 holds for adapters (their slots on the model's "
     "device, the adapters kept loaded in host memory).", lambda s: s.lora_memory_bytes),
)  # fmt: skip
ENGINE_COUNTERS: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("num_preemptions", "Preemptions by recompute.", lambda s: s.num_preempted_total),
    ("num_displaced", "Preemptions of a running request for a waiting one that found no "
     "seat or blocks (priority, edf).", lambda s: s.num_displaced_total),
    ("slo_waits", "edf: steps a waiting chat let a batch request keep its seat, its TTFT "
     "deadline still reachable.", lambda s: s.slo_waits_total),
    ("chunk_capped_steps", "edf with --slo-tpot-ms: steps whose batch prefill chunks were "
     "shrunk to keep the step under the TPOT SLO.", lambda s: s.chunk_capped_steps_total),
    ("pooling_limited_steps", "Steps whose pooled prompts (embeddings, scores) --pooling-share "
     "held back so that the step's decodes keep their pace.",
     lambda s: s.pooling_limited_steps_total),
    ("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
     lambda s: s.prefix_cache_hits_total),
    ("prefix_cache_queries", "Prompt tokens looked up.", lambda s: s.prefix_cache_queries_total),
    ("num_steps", "Model steps run.", lambda s: s.num_steps_total),
    ("worker_busy_seconds", "Seconds rank 0 spent running steps.",
     lambda s: s.worker_busy_time_total),
    ("worker_idle_seconds", "Seconds rank 0 waited for a plan between steps.",
     lambda s: s.worker_idle_time_total),
    ("scheduler_seconds", "Seconds the scheduler spent planning.",
     lambda s: s.scheduler_time_total),
    ("spec_decode_num_drafts", "Speculative decoding: steps of a request with a draft.",
     lambda s: s.spec_num_drafts_total),
    ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed.",
     lambda s: s.spec_draft_tokens_total),
    ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
     lambda s: s.spec_accepted_tokens_total),
    ("kv_transfer_blocks", "Disaggregation: KV blocks a decode engine copied in.",
     lambda s: s.kv_transfer_blocks_total),
    ("kv_transfer_failures", "Disaggregation: KV copies that failed or came too late (the "
     "decode engine computed the prompt itself).", lambda s: s.kv_transfer_failures_total),
    ("kv_leases_expired", "Disaggregation: a prefill engine's leases freed unreleased.",
     lambda s: s.kv_leases_expired_total),
    ("lora_loads", "LoRA: adapters rank 0 read from disk into memory.",
     lambda s: s.lora_loads_total),
    ("lora_evictions", "LoRA: adapters rank 0 dropped from memory to make room (--max-cpu-loras).",
     lambda s: s.lora_evictions_total),
)  # fmt: skip


class _EngineCollector:
    """The engine's figures at scrape time, from the latest EngineStats (zeros before any),
    and the messages refused anywhere on the internal plane and at the ZMQ endpoint."""

    def __init__(
        self,
        model_name: str,
        rejected_here: Callable[[], int],
        roles: list[str],
        lora_names: Callable[[], dict[int, str]],
    ) -> None:
        self.model_name = model_name
        self.roles = roles
        self.stats = [EngineStats() for _ in roles]
        self.rejected_here = rejected_here
        self.lora_names = lora_names

    def collect(self) -> Iterator[Metric]:
        """One series per engine, labelled `engine`; the frontend's own refusals (its links
        and its ZMQ endpoint) are counted in engine 0's."""
        label_names = ["model_name", "engine", "role"]
        per_engine = [
            ([self.model_name, str(i), role], s)
            for i, (role, s) in enumerate(zip(self.roles, self.stats, strict=True))
        ]
        for name, doc, value in ENGINE_GAUGES:
            g = GaugeMetricFamily(f"subway:{name}", doc, labels=label_names)
            for labels, s in per_engine:
                g.add_metric(labels, value(s))
            yield g
        for name, doc, value in ENGINE_COUNTERS:
            c = CounterMetricFamily(f"subway:{name}", doc, labels=label_names)
            for labels, s in per_engine:
                c.add_metric(labels, value(s))
            yield c
        c = CounterMetricFamily(
            "subway:ipc_rejected_messages",
            "Messages refused as malformed or unexpected: by the scheduler, the workers, "
            "the frontend's link and its native ZMQ endpoint.",
            labels=label_names,
        )
        h = HistogramMetricFamily(
            "subway:kv_transfer_seconds",
            "Disaggregation: seconds a decode engine's KV copy took (its slowest rank).",
            labels=label_names,
        )
        for labels, s in per_engine:
            counts = s.kv_transfer_buckets or [0] * len(KV_TRANSFER_BUCKETS)
            buckets = [(str(b), c) for b, c in zip(KV_TRANSFER_BUCKETS, counts, strict=True)]
            buckets.append(("+Inf", s.kv_transfer_count))
            h.add_metric(labels, buckets, s.kv_transfer_seconds_sum)
        yield h
        here = self.rejected_here()
        for i, (labels, s) in enumerate(per_engine):
            c.add_metric(labels, s.ipc_rejected_total + (here if i == 0 else 0))
        yield c
        yield from self._lora(per_engine)
        yield from self._moe(per_engine)

    def _moe(self, per_engine: list[tuple[list[str], EngineStats]]) -> Iterator[Metric]:
        """A mixture of experts' routing: tokens per expert summed over layers (one series
        per expert, not per layer and expert: bounded), and how uneven that load is."""
        label_names = ["model_name", "engine", "role"]
        c = CounterMetricFamily(
            "subway:moe_expert_tokens",
            "Mixture of experts: tokens routed to each expert since start, summed over layers.",
            labels=[*label_names, "expert"],
        )
        g = GaugeMetricFamily(
            "subway:moe_expert_load_imbalance",
            "Mixture of experts: the busiest expert's tokens over the mean expert's, since "
            "start (1: even; 0 before any).",
            labels=label_names,
        )
        for labels, s in per_engine:
            counts = s.moe_expert_tokens_total
            for e, n in enumerate(counts):
                c.add_metric([*labels, str(e)], n)
            total = sum(counts)
            g.add_metric(labels, max(counts) * len(counts) / total if total else 0.0)
        yield c
        yield g

    def _lora(self, per_engine: list[tuple[list[str], EngineStats]]) -> Iterator[Metric]:
        """The adapters served (the frontend's registry), and each engine's requests of each
        adapter, by name (ids no longer served are left out: bounded labels)."""
        names = self.lora_names()
        served = GaugeMetricFamily(
            "subway:lora_adapters", "LoRA adapters served.", labels=["model_name"]
        )
        served.add_metric([self.model_name], len(names))
        yield served
        g = GaugeMetricFamily(
            "subway:lora_running_requests",
            "LoRA: an engine's requests (running or waiting) of each adapter.",
            labels=["model_name", "engine", "role", "adapter"],
        )
        for labels, s in per_engine:
            for lora_id, n in sorted(s.lora_requests.items()):
                name = names.get(lora_id)
                if name is not None:
                    g.add_metric([*labels, name], n)
        yield g


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        model_name: str,
        rejected_here: Callable[[], int] = lambda: 0,
        roles: list[str] | None = None,
        lora_names: Callable[[], dict[int, str]] = dict,
    ) -> None:
        """`rejected_here`: messages this frontend refused (its links, its ZMQ endpoint);
        `lora_names`: the LoRA adapters served, name by id (`LoraRegistry.names`)."""
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name
        self._engine = _EngineCollector(model_name, rejected_here, roles or ["both"], lora_names)
        r.register(self._engine)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"subway:{name}", doc, label + list(extra), registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"subway:{name}", doc, label, buckets=LATENCY_BUCKETS, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request of more than one token: (end-to-end - TTFT) / (output tokens - 1).",
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to the first scheduled step."
        )
        self.grammar_seconds = Histogram(
            "subway:grammar_compile_seconds",
            "Time the frontend took to compile (check) a structured-output grammar.",
            label,
            buckets=GRAMMAR_BUCKETS,
            registry=r,
        )
        self.grammar_compiles = counter(
            "grammar_compiles",
            "Structured-output grammars compiled by the frontend, by result (cold, cached, error).",
            ("result",),
        )
        self.routed = counter(
            "routed_requests",
            "Engine requests sent to each data-parallel engine, by why: prefix (its cache "
            "held the prompt's prefix), least_loaded, overloaded (the engine holding the "
            "prefix was overloaded).",
            ("engine", "reason"),
        )
        self.lora_requests = counter(
            "lora_requests",
            "LoRA: engine requests (choices) submitted with each adapter served.",
            ("adapter",),
        )
        for metric in (
            self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
            self.tpot, self.queue_time,
        ):  # fmt: skip
            metric.labels(model_name)  # every series exists from the start, at 0
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        self.grammar_seconds.labels(model_name)
        for result in ("cold", "cached", "error"):
            self.grammar_compiles.labels(model_name, result)

    def observe_stats(self, s: EngineStats, engine: int = 0) -> None:
        """An engine's latest figures, exported as they are at the next scrape."""
        self._engine.stats[engine] = s

    def observe_route(self, route: Route) -> None:
        self.routed.labels(self.model_name, str(route.engine), route.reason).inc()

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
        self,
        prompt_tokens: int,
        output_tokens: int,
        e2e: float,
        finish_reason: str,
        ttft: float | None = None,
    ) -> None:
        """One engine request ended, however it ended (finish_reason "abort" when cut);
        `ttft`: when its first token came, if one did."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.success.labels(m, finish_reason).inc()
        self.e2e.labels(m).observe(max(0.0, e2e))
        if ttft is not None and output_tokens > 1:
            self.tpot.labels(m).observe(max(0.0, e2e - ttft) / (output_tokens - 1))

    def adapter_added(self, name: str) -> None:
        """A LoRA adapter is served: its request counter exists from now on, at 0."""
        self.lora_requests.labels(self.model_name, name)

    def adapter_removed(self, name: str) -> None:
        """A LoRA adapter is no longer served: its counter goes (labels stay bounded by the
        adapters served; one loaded again under the name starts again at 0)."""
        with contextlib.suppress(KeyError):
            self.lora_requests.remove(self.model_name, name)

    def observe_lora_requests(self, name: str, n: int) -> None:
        self.lora_requests.labels(self.model_name, name).inc(n)

    def observe_grammar_compile(self, result: str, seconds: float) -> None:
        """One grammar compiled by the frontend's check: "cold", "cached" or "error"."""
        m = self.model_name
        self.grammar_compiles.labels(m, result).inc()
        self.grammar_seconds.labels(m).observe(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)
