"""The scheduler's own cost per step, with a worker that answers at once (no torch, no model).

Drives the real `Scheduler` through the `EngineCore` loop with overlap, as the
scheduler process does (plan N+1 is built before result N is settled), and
times, per step:

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
    Plan,
    SamplingParams,
    StepResult,
    TokenRef,
    ToWorker,
)
from subway.scheduler.engine_core import EngineCore
from subway.scheduler.scheduler import Scheduler
from subway.tools.bench.null_worker import NullWorker

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


class CodecWorker(NullWorker):
    """A NullWorker behind the codecs, as the scheduler process sees its workers: plans
    encoded, results decoded (`codec` seconds); the worker's own time is kept apart."""

    def __init__(self, clock) -> None:
        super().__init__(token=7)
        self.clock = clock
        self.plan_codec = Codec(ToWorker)
        self.result_codec = Codec(FromWorker)
        self.raw: list[bytes] = []
        self.codec = 0.0
        self.worker = 0.0
        self.last_plan: Plan | None = None

    def submit(self, plan: Plan) -> None:
        pc = self.clock
        t0 = pc()
        self.plan_codec.encode(plan)
        t1 = pc()
        self.raw.append(self.result_codec.encode(self.run(plan)[0]))
        self.codec += t1 - t0
        self.worker += pc() - t1
        self.last_plan = plan

    def collect(self) -> list[tuple[StepResult, list[int]]]:
        if not self.raw:
            return []
        t0 = self.clock()
        msg = self.result_codec.decode(self.raw.pop(0))
        self.codec += self.clock() - t0
        return [(msg, msg.tokens.ids)]


class Driver:
    def __init__(self, sched: Scheduler, seed: int, clock=time.thread_time) -> None:
        self.sched = sched
        self.clock = clock
        self.worker = CodecWorker(clock)
        self.core = EngineCore(sched, self.worker, depth=2)
        self.rng = random.Random(seed)
        self.system = [self.rng.randrange(1, 32000) for _ in range(SYSTEM)]
        self.next_id = 0
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

    def step(self, times: dict[str, list[float]] | None) -> Plan | None:
        """One turn of the loop: settle the older result, then plan (in steady state one
        plan a turn); the turn's plan, if it made one."""
        w = self.worker
        pc = self.clock
        w.last_plan = None
        c0, o0 = w.codec, w.worker
        t0 = pc()
        self.core.settle()
        t1 = pc()
        c1 = w.codec
        self.core.plan()
        t2 = pc()
        plan = w.last_plan
        t_result = (t1 - t0) - (c1 - c0)
        t_schedule = (t2 - t1) - (w.codec - c1) - (w.worker - o0)
        t_codec = w.codec - c0
        if times is not None:
            if plan is None:  # waiting for a result: its cost goes to the next step
                self.carry[0] += t_result + t_schedule
                self.carry[1] += t_codec
            else:
                times["schedule"].append(t_schedule)
                times["result"].append(t_result + self.carry[0])
                times["codec"].append(t_codec + self.carry[1])
                self.carry = [0.0, 0.0]
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
    q0, h0 = sched.stats.prefix_queries_total, sched.stats.prefix_hits_total
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
    q = sched.stats.prefix_queries_total - q0
    h = sched.stats.prefix_hits_total - h0
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
