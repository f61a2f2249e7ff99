"""The scheduler's own cost per step, with a worker that answers at once (no torch, no model).

Drives the real `Scheduler` the way the scheduler process does with overlap
(plan N+1 is built before result N is settled) and times, per step:

- `schedule`: building the plan;
- `result`: settling a step result (appending tokens, finishing, deltas);
- `codec`: msgspec-encoding the plan and decoding the result, as the process does;
- `total`: the three together: the scheduler process's time per step, all but
  the socket calls.

Times are the thread's CPU time by default (`--clock cpu`): the scheduler's
own time, which other processes on a shared machine do not inflate; `--clock
wall` gives elapsed time instead. Python's garbage collector stays on.

Two kinds of step, at each number of running sequences N:

- `decode`: N sequences that only decode (prompts of 128 tokens, done before
  timing starts; outputs long enough never to finish while timed; a pool
  large enough never to preempt);
- `mixed`: N seats kept full by a stream of requests (prompts of 64..512
  tokens whose first 64 are shared by all, so the prefix cache hits; N/4..N
  output tokens, so that about as many finish per step as the prefill budget
  lets in): each step has the running decodes plus prefill chunks up to the
  budget of N + 512 tokens, admissions, finishes, cache lookups and keying.

    python -m subway.tools.bench.bench_scheduler [--sizes 1 64 256 1024] [--steps 600] [--repeat 1]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass

from subway.ipc.config import EngineConfig
from subway.ipc.messages import (
    AddRequest,
    Codec,
    FromWorker,
    SamplingParams,
    TokenRef,
    ToWorker,
)
from subway.scheduler.fake_worker import NullWorker
from subway.scheduler.scheduler import Scheduler

EOS = 0
SYSTEM = 64  # tokens of the shared prefix in mixed steps


@dataclass
class Row:
    running: int
    kind: str
    steps: int
    schedule: list[float]
    result: list[float]
    codec: list[float]
    total: list[float]
    tokens_per_step: float
    seqs_per_step: float
    prefill_seqs_per_step: float
    hit_rate: float


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def make_scheduler(n: int, budget: int, num_blocks: int, block_size: int, policy: str,
                   caching: bool) -> Scheduler:  # fmt: skip
    config = EngineConfig.build(
        run_id="bench",
        max_num_seqs=n,
        max_num_batched_tokens=budget,
        block_size=block_size,
        policy=policy,
        enable_prefix_caching=caching,
    )
    return Scheduler(config, num_blocks, 1 << 30, [EOS])


class Driver:
    def __init__(self, sched: Scheduler, seed: int, clock=time.thread_time) -> None:
        self.sched = sched
        self.clock = clock
        self.worker = NullWorker(token=7)
        self.rng = random.Random(seed)
        self.system = [self.rng.randrange(1, 32000) for _ in range(SYSTEM)]
        self.next_id = 0
        self.pending: list = []  # (result, tokens) of plans in flight, oldest first
        self.plan_codec = Codec(ToWorker)
        self.result_codec = Codec(FromWorker)
        self.carry = [0.0, 0.0]  # result and codec time of turns that planned nothing

    def add(self, prompt_len: int, max_tokens: int, shared: bool) -> None:
        rng = self.rng
        head = self.system[: min(prompt_len, SYSTEM)] if shared else []
        prompt = head + [rng.randrange(1, 32000) for _ in range(prompt_len - len(head))]
        rid = f"r{self.next_id}"
        self.next_id += 1
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        # The prompt as one host sends it: a run in the shared-memory buffer (never read here).
        ref = TokenRef(offset=0, length=len(prompt))
        arrival = 0.01 * self.next_id  # deterministic, for policies whose keys read it
        req = AddRequest(rid, ref, len(prompt), sp, arrival_time=arrival)
        self.sched.add(req, prompt)

    def step(self, times: dict[str, list[float]] | None) -> object:
        """One turn of the process loop with overlap: plan, then settle the older result."""
        sched = self.sched
        pc = self.clock
        t0 = pc()
        plan = sched.schedule()
        t1 = pc()
        data = self.plan_codec.encode(plan) if plan is not None else b""
        t2 = pc()
        if plan is not None:
            result, tokens = self.worker.run(plan)
            self.pending.append(self.result_codec.encode(result))
        t_result = t_codec = 0.0
        if len(self.pending) >= 2 or (plan is None and self.pending):
            raw = self.pending.pop(0)
            t3 = pc()
            msg = self.result_codec.decode(raw)
            t4 = pc()
            sched.process_result(msg, msg.tokens.ids)
            t5 = pc()
            t_result, t_codec = t5 - t4, t4 - t3
        if times is not None:
            if plan is None:  # waiting for a result: its cost goes to the next step
                self.carry[0] += t_result + t1 - t0
                self.carry[1] += t_codec
            else:
                times["schedule"].append(t1 - t0)
                times["result"].append(t_result + self.carry[0])
                times["codec"].append(t2 - t1 + t_codec + self.carry[1])
                self.carry = [0.0, 0.0]
        del data
        return plan


def bench(n: int, kind: str, steps: int, block_size: int, policy: str, caching: bool,
          seed: int, clock=time.thread_time) -> Row:  # fmt: skip
    if kind == "decode":
        budget = n + 2048  # the prompts are in within n * 128 / 2048 steps
        longest = 128 + n * 128 // 2048 + steps + 16
        blocks = n * (-(-longest // block_size) + 1) + 64
        sched = make_scheduler(n, budget, blocks, block_size, policy, caching)
        d = Driver(sched, seed, clock)
        for _ in range(n):
            d.add(128, 1 << 20, shared=False)
        while sched.num_waiting or any(s.num_computed_tokens < 128 for s in sched.running):
            d.step(None)
        for _ in range(4):
            d.step(None)
    else:
        budget = n + 512
        blocks = (n + 8) * (-(-(512 + n + 16) // block_size) + 1) + 64
        sched = make_scheduler(n, budget, blocks, block_size, policy, caching)
        d = Driver(sched, seed, clock)
    rng = d.rng

    def top_up() -> None:
        while sched.num_running + sched.num_waiting < n + 2:
            d.add(rng.randrange(64, 513), 8 + rng.randrange(n // 4, n + 1), shared=True)

    if kind == "mixed":
        for _ in range(100 + n):  # reach a steady state
            top_up()
            d.step(None)
    times: dict[str, list[float]] = {"schedule": [], "result": [], "codec": []}
    tokens = seqs = prefills = 0
    q0, h0 = getattr(sched, "prefix_queries_total", 0), getattr(sched, "prefix_hits_total", 0)
    gc.collect()
    for _ in range(steps):
        if kind == "mixed":
            top_up()
        plan = d.step(times)
        while plan is None:  # the only running sequence has its last token in flight
            plan = d.step(times)
        tokens += sum(s.num_tokens for s in plan.seqs)
        seqs += len(plan.seqs)
        prefills += sum(1 for s in plan.seqs if s.num_tokens > 1)
        if kind == "decode":
            assert len(plan.seqs) == n and prefills == 0
    total = [
        a + b + c
        for a, b, c in zip(times["schedule"], times["result"], times["codec"], strict=True)
    ]
    q = getattr(sched, "prefix_queries_total", 0) - q0  # (absent in older schedulers)
    h = getattr(sched, "prefix_hits_total", 0) - h0
    return Row(n, kind, steps, times["schedule"], times["result"], times["codec"], total,
               tokens / steps, seqs / steps, prefills / steps, h / q if q else 0.0)  # fmt: skip


def us(x: float) -> str:
    return f"{x * 1e6:.0f}"


def table(rows: list[Row]) -> str:
    head = (
        "| running | step | schedule med / p99 (us) | result med / p99 | codec med | "
        "**total med / p99** | seqs, prefills, tokens per step |"
    )
    lines = [head, "|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r.running} | {r.kind} | {us(statistics.median(r.schedule))} / "
            f"{us(pct(r.schedule, 0.99))} | {us(statistics.median(r.result))} / "
            f"{us(pct(r.result, 0.99))} | {us(statistics.median(r.codec))} | "
            f"**{us(statistics.median(r.total))} / {us(pct(r.total, 0.99))}** | "
            f"{r.seqs_per_step:.0f}, {r.prefill_seqs_per_step:.1f}, {r.tokens_per_step:.0f}"
            + (f" (prefix hits {100 * r.hit_rate:.0f}%)" if r.kind == "mixed" else "")
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256, 1024])
    p.add_argument("--kinds", nargs="+", default=["decode", "mixed"], choices=["decode", "mixed"])
    p.add_argument("--steps", type=int, default=600, help="timed steps per row")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="runs per row, their steps pooled")
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: the thread's CPU time (what the scheduler itself spends, robust to other "
        "load on the machine); wall: elapsed time (includes being descheduled)",
    )
    a = p.parse_args(argv)
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    rows = []
    for n in a.sizes:
        for kind in a.kinds:
            runs = [
                bench(
                    n,
                    kind,
                    a.steps,
                    a.block_size,
                    a.policy,
                    not a.no_prefix_caching,
                    a.seed + i,
                    clock,
                )  # fmt: skip
                for i in range(a.repeat)
            ]
            row = runs[0]
            for other in runs[1:]:
                for name in ("schedule", "result", "codec", "total"):
                    getattr(row, name).extend(getattr(other, name))
            rows.append(row)
            print(
                f"  {n:>5} {kind:<6} total median {us(statistics.median(row.total))} us, "
                f"p99 {us(pct(row.total, 0.99))} us",
                file=sys.stderr,
            )
    print(
        f"python {sys.version.split()[0]}, policy {a.policy}, block size {a.block_size}, "
        f"prefix caching {'off' if a.no_prefix_caching else 'on'}, "
        f"{a.steps} x {a.repeat} timed steps per row, "
        f"{a.clock} time"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
