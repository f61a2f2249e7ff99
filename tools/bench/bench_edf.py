"""Interactive TTFT under `edf` against `fcfs` (and others) on one mixed workload, simulated.

Drives the real `Scheduler` with a fake worker whose step time is a cost
model, on a simulated clock: nothing sleeps, and the same seed gives the same
figures on any machine.

Cost model: a step that computes T tokens (prefill chunks and decodes
together) takes `--step-overhead-ms` + T x `--token-ms` (defaults 10 ms +
0.1 ms per token: a decode step of 32 sequences takes 13.2 ms, a full
2048-token step 214.8 ms). Steps run one after another (no overlap); a
token sampled by a step is seen when the step ends.

Workload (`--seed`, `--duration`): long batch jobs (class `batch`, no SLO)
are queued at t=0 (`--batch-jobs` 48, prompts of 2000..4000 tokens, 300..600
output tokens) and keep arriving (one every `--batch-every` 4 seconds);
interactive chat requests (class `interactive`, TTFT SLO `--slo-ms` 1000) arrive as
a Poisson stream at `--chat-rate` 1 per second for `--duration` 120 s, prompts 100..500 tokens (the
first 64 are a shared system prompt), 20..150 output tokens. Every request
ignores EOS. The engine: `--max-num-seqs` 32, `--max-num-batched-tokens`
2048, `--num-blocks` 4096 blocks of 16 tokens, prefix caching on.

    python -m subway.tools.bench.bench_edf [--policies fcfs edf] [--seed 0] [--duration 120]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field

from subway.ipc.config import EngineConfig
from subway.ipc.messages import AddRequest, SamplingParams, TokenRef
from subway.scheduler.engine_core import EngineCore
from subway.scheduler.scheduler import Scheduler
from subway.tools.bench.null_worker import NullWorker

EOS = 0


@dataclass
class Job:
    rid: str
    arrival: float
    prompt: list[int]
    max_tokens: int
    slo_class: str
    slo_ttft_ms: float | None
    priority: int


@dataclass
class Outcome:
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0


@dataclass
class Result:
    policy: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    sim_time: float = 0.0
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    prefix_hit_rate: float = 0.0


def workload(args) -> list[Job]:
    rng = random.Random(args.seed)  # the chat stream
    brng = random.Random(args.seed + 1)  # the batch jobs: the chat stream does not depend on them
    system = [rng.randrange(1, 32000) for _ in range(64)]
    jobs: list[Job] = []

    def batch(t: float) -> None:
        plen = brng.randrange(2000, 4001)
        jobs.append(
            Job(f"batch{len(jobs)}", t, [brng.randrange(1, 32000) for _ in range(plen)],
                brng.randrange(300, 601), "batch", None, 1)
        )  # fmt: skip

    for _ in range(args.batch_jobs):
        batch(0.0)
    t = args.batch_every
    while t < args.duration:
        batch(t)
        t += args.batch_every
    t = rng.expovariate(args.chat_rate)
    while t < args.duration:
        plen = rng.randrange(100, 501)
        prompt = system + [rng.randrange(1, 32000) for _ in range(plen - len(system))]
        jobs.append(
            Job(f"chat{len(jobs)}", t, prompt, rng.randrange(20, 151), "interactive",
                args.slo_ms, 0)
        )  # fmt: skip
        t += rng.expovariate(args.chat_rate)
    jobs.sort(key=lambda j: j.arrival)
    return jobs


def simulate(policy: str, jobs: list[Job], args) -> Result:
    now = 0.0
    config = EngineConfig.build(
        run_id="edf",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=16,
        policy=policy,
        enable_prefix_caching=True,
    )
    sched = Scheduler(config, args.num_blocks, 1 << 20, [EOS], clock=lambda: now)
    worker = NullWorker(token=7)
    core = EngineCore(sched, worker, depth=1, clock=lambda: now)  # step times: simulated
    res = Result(policy)
    i = 0
    while True:
        while i < len(jobs) and jobs[i].arrival <= now:
            j = jobs[i]
            i += 1
            sp = SamplingParams(max_tokens=j.max_tokens, ignore_eos=True)
            req = AddRequest(j.rid, TokenRef(ids=j.prompt), len(j.prompt), sp, j.arrival,
                             priority=j.priority, slo_ttft_ms=j.slo_ttft_ms,
                             slo_class=j.slo_class)  # fmt: skip
            sched.add(req, j.prompt)
            res.outcomes[j.rid] = Outcome()
        # Settles the last plan (it ended at `now`), then makes the next one.
        for d in core.step():
            o = res.outcomes[d.request_id]
            if d.token_ids and o.first_token is None:
                o.first_token = now
            o.tokens += len(d.token_ids)
            if d.finish_reason is not None:
                o.finished = now
        if worker.queued:
            tokens = sum(s.num_tokens for s in worker.queued[-1].seqs)
            now += (args.step_overhead_ms + args.token_ms * tokens) / 1000.0
            res.steps += 1
            res.tokens += tokens
        elif sched.has_work:
            raise RuntimeError("the scheduler has work but planned nothing")
        elif i == len(jobs):
            break
        else:
            now = max(now, jobs[i].arrival)  # idle until the next arrival
    res.sim_time = now
    res.preemptions = sched.num_preempted_total
    q = sched.stats.prefix_queries_total
    res.prefix_hit_rate = sched.stats.prefix_hits_total / q if q else 0.0
    return res


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def report(results: list[Result], jobs: list[Job], args) -> str:
    arrival = {j.rid: j.arrival for j in jobs}
    lines = [
        "| policy | interactive TTFT p50 / p90 / **p99** (s) | within SLO | "
        "batch jobs done, mean / max E2E (s) | all done at (s) | steps | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ttft = [o.first_token - arrival[k] for k, o in r.outcomes.items() if k.startswith("chat")]
        ok = sum(t * 1000 <= args.slo_ms for t in ttft)
        e2e = [o.finished - arrival[k] for k, o in r.outcomes.items() if k.startswith("batch")]
        lines.append(
            f"| {r.policy} | {pct(ttft, 0.5):.2f} / {pct(ttft, 0.9):.2f} / "
            f"**{pct(ttft, 0.99):.2f}** | {100 * ok / len(ttft):.0f}% | "
            f"{len(e2e)}, {sum(e2e) / len(e2e):.0f} / {max(e2e):.0f} | "
            f"{r.sim_time:.0f} | {r.steps} | {r.preemptions} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=["fcfs", "edf"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    p.add_argument("--chat-rate", type=float, default=1.0, help="interactive requests per s")
    p.add_argument("--slo-ms", type=float, default=1000.0, help="interactive TTFT SLO")
    p.add_argument("--batch-jobs", type=int, default=48, help="batch jobs queued at t=0")
    p.add_argument("--batch-every", type=float, default=4.0, help="then one every N s")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--step-overhead-ms", type=float, default=10.0)
    p.add_argument("--token-ms", type=float, default=0.1)
    a = p.parse_args(argv)
    jobs = workload(a)
    n_chat = sum(j.slo_class == "interactive" for j in jobs)
    results = [simulate(name, jobs, a) for name in a.policies]
    print(
        f"{n_chat} interactive requests (SLO {a.slo_ms:.0f} ms), {len(jobs) - n_chat} batch jobs; "
        f"cost model {a.step_overhead_ms:g} ms + {a.token_ms:g} ms/token per step; seed {a.seed}"
    )
    print(report(results, jobs, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
