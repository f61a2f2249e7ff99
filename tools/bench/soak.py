"""Soak benchmark: many mixed requests against one `subway serve`, then check that nothing leaked.

Starts `subway serve` (the default model unless `--model`) on a free port with a run id of
its own, or drives a running server (`--url`; its processes are found from the HTTP port).
`--concurrency` closed-loop clients send `--requests` requests: completions and chat, prompt
lengths from a few words to 400 (mean about 45), `max_tokens` 1..32, greedy, temperature and
top_p sampling, streamed and not, mostly with `ignore_eos` so that lengths can be checked;
`--disconnect-frac` of all requests are streams the client drops mid-answer;
`--constrained-frac` (a quarter) carry structured outputs (a JSON object, or one of 50 JSON
schemas, so that grammars come and go) or tools (`tool_choice` "required", chat).

Reported: requests/s; the RSS of every engine process (frontend, scheduler, each worker)
after `--rss-at` requests and at the end; from `/metrics`, KV blocks in use and requests
running and waiting, polled until they are back to zero (and how long that took). Bars,
printed PASS/FAIL, exit status 1 on any FAIL:

- no errors: every request that was not dropped on purpose got a whole answer;
- lengths: finish_reason "length" means exactly max_tokens completion tokens, "stop" fewer
  (and never "stop" under ignore_eos);
- nothing leaked: blocks, running and waiting back to zero within `--settle-bar` seconds;
- RSS: growth under `--rss-bar-mb` per process between the two samples.

    python -m subway.tools.bench.soak                      # 10,000 requests, 32 clients
    python -m subway.tools.bench.soak --requests 300 --concurrency 8 --model PATH
    python -m subway.tools.bench.soak --url http://127.0.0.1:8000
    python -m subway.tools.bench.soak --requests 200 -- --max-num-seqs 16   # serve flags after --
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from typing import Any

import httpx
import psutil

from subway.tools.bench.bench_serving import parse_prometheus, server_model
from subway.tools.serve_process import ServeProcess, engine_processes
from subway.tools.serve_process import free_port as free_port  # for tools/bench/chaos.py

GAUGES = (
    "subway:num_requests_running",
    "subway:num_requests_waiting",
    "subway:kv_cache_usage_perc",
    "subway:kv_blocks_free",
)
WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be "
    "river mountain engine signal harbour lantern quiet copper meadow orbit thunder violet "
    "station ticket carriage platform tunnel junction timetable commuter conductor"
).split()
PREAMBLE = "You are a careful assistant. Answer briefly and stay on topic. "  # a shared prefix


# ---------------------------------------------------------------- a server of our own
# (ServeProcess, engine_processes: subway.tools.serve_process)


def serve_pid_of(url: str) -> int | None:
    """The `subway serve` above the process listening on the URL's port, if it is ours."""
    port = httpx.URL(url).port
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            parent = psutil.Process(conn.pid).parent()
            if parent is not None and "serve" in parent.cmdline():
                return parent.pid
    return None


def rss_mb(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        try:
            out[name] = p.memory_info().rss / 2**20
        except psutil.Error:
            out[name] = float("nan")
    return out


# ---------------------------------------------------------------- the workload


@dataclasses.dataclass
class Spec:
    """One request to send; `disconnect_after` chunks with text, then the client hangs up."""

    chat: bool
    prompt: str
    max_tokens: int
    stream: bool
    ignore_eos: bool
    sampling: dict[str, Any]
    disconnect_after: int | None = None
    constraint: str = ""  # "", "json_object", "schema:K" (one of 50 schemas) or "tools"


@dataclasses.dataclass
class Outcome:
    status: str = "error"  # "ok", "dropped" (disconnected on purpose) or "error"
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str = ""


def make_specs(
    n: int, seed: int = 0, disconnect_frac: float = 0.2, constrained_frac: float = 0.25
) -> list[Spec]:
    """The mixed workload: deterministic for a seed."""
    rng = random.Random(seed)
    specs = []
    dropped = set(rng.sample(range(n), round(n * disconnect_frac)))
    for i in range(n):
        u = rng.random()
        words = rng.randint(3, 40) if u < 0.8 else rng.randint(40, 150) if u < 0.98 else 400
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        if rng.random() < 0.3:
            text = PREAMBLE + text
        kind = rng.random()
        if kind < 0.4:
            sampling: dict[str, Any] = {"temperature": 0.0}
        elif kind < 0.7:
            sampling = {"temperature": round(rng.uniform(0.5, 1.3), 2)}
        else:
            sampling = {"temperature": 1.0, "top_p": round(rng.uniform(0.3, 0.95), 2)}
        if rng.random() < 0.3:
            sampling["seed"] = rng.randrange(2**31)
        drop = i in dropped
        max_tokens = rng.randint(8, 32) if drop else rng.randint(1, 32)
        specs.append(
            Spec(
                chat=rng.random() < 0.3,
                prompt=text,
                max_tokens=max_tokens,
                stream=drop or rng.random() < 0.5,
                ignore_eos=drop or rng.random() < 0.85,
                sampling=sampling,
                disconnect_after=rng.randint(1, max_tokens // 2) if drop else None,
            )
        )
        if rng.random() < constrained_frac:
            spec = specs[-1]
            c = rng.random()
            spec.constraint = (
                "json_object" if c < 0.3 else "tools" if c < 0.6 else f"schema:{rng.randrange(50)}"
            )
            spec.chat = spec.chat or spec.constraint == "tools"
            spec.ignore_eos = False  # a grammar ends the answer where it is complete
    return specs


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
]


def _constraint(spec: Spec) -> dict[str, Any]:
    """The body fields of a spec's constraint."""
    if spec.constraint == "json_object":
        return {"response_format": {"type": "json_object"}}
    if spec.constraint == "tools":
        return {"tools": TOOLS, "tool_choice": "required"}
    k = spec.constraint.split(":", 1)[1]
    schema = {
        "type": "object",
        "properties": {f"field_{k}": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": [f"field_{k}"],
    }
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": f"s{k}", "schema": schema},
        }
    }


def body_of(spec: Spec, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "n": 1}
    body.update(spec.sampling, stream=spec.stream, ignore_eos=spec.ignore_eos)
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.constraint:
        body.update(_constraint(spec))
    return body


async def send(client: httpx.AsyncClient, base: str, model: str, spec: Spec) -> Outcome:
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    out = Outcome()
    try:
        if not spec.stream:
            r = await client.post(base + path, json=body_of(spec, model))
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            msg = r.json()
            out.finish_reason = msg["choices"][0]["finish_reason"]
            out.completion_tokens = msg["usage"]["completion_tokens"]
            out.status = "ok"
            return out
        chunks = 0
        async with client.stream("POST", base + path, json=body_of(spec, model)) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.status = "ok"
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    out.error = str(msg["error"])[:200]
                    return out
                if msg.get("usage"):
                    out.completion_tokens = msg["usage"]["completion_tokens"]
                for c in msg.get("choices") or ():
                    out.finish_reason = c.get("finish_reason") or out.finish_reason
                    delta = c.get("delta") or {}
                    if c.get("text") or delta.get("content") or delta.get("tool_calls"):
                        chunks += 1
                if spec.disconnect_after is not None and chunks >= spec.disconnect_after:
                    out.status = "dropped"
                    break  # leaving the block closes the connection mid-stream
        if out.status == "error" and not out.error:
            out.error = "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        out.status, out.error = "error", f"{type(e).__name__}: {e}"[:200]
    return out


def length_ok(spec: Spec, out: Outcome) -> bool:
    """A completed request is as long as it says: "length" is exactly max_tokens, "stop" at
    most that (never under ignore_eos): a stop token sampled as the last allowed token
    ends the request "stop" and is counted, as in vLLM (the 10,000-request soak of
    issue 43 met one: max_tokens 18, "stop", 18 tokens); a constrained one may also end
    with its grammar ("stop", "tool_calls")."""
    if spec.constraint and out.finish_reason in ("stop", "tool_calls"):
        return (out.completion_tokens or 0) <= spec.max_tokens
    if out.finish_reason == "length":
        return out.completion_tokens == spec.max_tokens
    if out.finish_reason == "stop":
        return not spec.ignore_eos and (out.completion_tokens or 0) <= spec.max_tokens
    return False


async def drive(
    base: str,
    specs: list[Spec],
    concurrency: int,
    on_progress: Any = None,
    timeout: float = 300.0,
) -> tuple[list[Outcome], float]:
    """Send every spec from `concurrency` closed-loop clients; `on_progress(done)` is called
    after each request ends (it may block briefly: it samples RSS)."""
    outcomes: list[Outcome] = [Outcome() for _ in specs]
    queue = iter(range(len(specs)))
    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        model = await server_model(client, base)
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal done
            for i in queue:
                outcomes[i] = await send(client, base, model, specs[i])
                done += 1
                if on_progress is not None:
                    on_progress(done)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outcomes, time.perf_counter() - t0


# ---------------------------------------------------------------- after the run


def gauges(base: str) -> dict[str, float] | None:
    try:
        return parse_prometheus(httpx.get(base + "/metrics", timeout=10).text, GAUGES)
    except httpx.HTTPError:
        return None


def idle_blocks(base: str, deadline_s: float = 30.0) -> float:
    """KV blocks free on an idle engine (all of them), once its first stats have arrived
    (until then /metrics reads zeros)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < deadline_s:
        g = gauges(base) or {}
        if g.get("subway:kv_blocks_free", 0.0) > 0:
            return g["subway:kv_blocks_free"]
        time.sleep(0.1)  # polling a condition under a deadline
    raise RuntimeError(f"{base}/metrics shows no KV blocks after {deadline_s} s")


def settle(base: str, blocks_total: float, deadline_s: float = 60.0) -> tuple[float, dict]:
    """Poll /metrics until no request runs or waits and every KV block is free again.
    Returns the seconds that took (inf if never) and the last figures."""
    t0 = time.perf_counter()
    last: dict = {}
    while time.perf_counter() - t0 < deadline_s:
        last = gauges(base) or {}
        if (
            last
            and last["subway:num_requests_running"] == 0
            and last["subway:num_requests_waiting"] == 0
            and last["subway:kv_cache_usage_perc"] == 0
            and last["subway:kv_blocks_free"] == blocks_total
        ):
            return time.perf_counter() - t0, last
        time.sleep(0.1)  # polling a condition under a deadline
    return float("inf"), last


def report(args: argparse.Namespace, run: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The bar checks: (name, passed, detail)."""
    specs, outs = run["specs"], run["outcomes"]
    errors = [o.error for o in outs if o.status == "error"]
    bad_len = [
        (s.max_tokens, o.finish_reason, o.completion_tokens, s.ignore_eos)
        for s, o in zip(specs, outs, strict=True)
        if o.status == "ok" and not length_ok(s, o)
    ]
    checks = [
        (
            "no errors",
            not errors,
            f"{len(errors)} errors" + (f", first: {errors[0]}" if errors else ""),
        ),
        (
            "lengths",
            not bad_len,
            f"{len(bad_len)} wrong of {sum(o.status == 'ok' for o in outs)} completed"
            + (f", e.g. (max_tokens, reason, tokens, ignore_eos)={bad_len[:3]}" if bad_len else ""),
        ),
        (
            "nothing leaked",
            run["settle_s"] <= args.settle_bar,
            f"back to zero in {run['settle_s']:.2f} s (bar {args.settle_bar} s); last {run['final']}",
        ),
    ]
    a, b = run["rss_first"], run["rss_end"]
    growth = {k: b.get(k, math.nan) - a[k] for k in a}
    gone = [k for k, g in growth.items() if math.isnan(g)]
    if not a:
        checks.append(("RSS growth", False, "no engine processes found to sample"))
    elif gone:
        checks.append(("RSS growth", False, f"not sampled at both points (exited?): {gone}"))
    else:
        worst = max(growth, key=lambda k: growth[k])
        ok = all(g < args.rss_bar_mb for g in growth.values())
        detail = f"max {growth[worst]:+.1f} MB ({worst}; bar {args.rss_bar_mb} MB)"
        checks.append(("RSS growth", ok, detail))
    return checks


def run_soak(args: argparse.Namespace) -> int:
    server = None
    if args.url:
        base = args.url.rstrip("/")
        pid = serve_pid_of(base)
        procs = engine_processes(pid) if pid else {}
    else:
        server = ServeProcess(args.model, *args.serve_args, prefix="soak")
        base, procs = server.url, server.processes()
        print(f"soak: serve at {base}, run id {server.run_id}, log {server.log.name}", flush=True)
    try:
        blocks_total = idle_blocks(base)
        specs = make_specs(args.requests, args.seed, args.disconnect_frac, args.constrained_frac)
        rss_at = args.rss_at if args.requests > args.rss_at else max(1, args.requests // 10)
        samples: dict[str, dict[str, float]] = {}
        t_start = time.perf_counter()

        def on_progress(done: int) -> None:
            if done == rss_at:
                samples["first"] = rss_mb(procs)
            if done % max(1, args.requests // 10) == 0:
                el = time.perf_counter() - t_start
                print(
                    f"soak: {done}/{args.requests} in {el:.0f} s ({done / el:.2f} req/s)",
                    flush=True,
                )

        outs, duration = asyncio.run(drive(base, specs, args.concurrency, on_progress))
        samples["end"] = rss_mb(procs)
        settle_s, final = settle(base, blocks_total)
        run = {
            "specs": specs,
            "outcomes": outs,
            "settle_s": settle_s,
            "final": {k.split(":")[1]: v for k, v in final.items()},
            "rss_first": samples.get("first", {}),
            "rss_end": samples["end"],
        }
        counts = {k: sum(o.status == k for o in outs) for k in ("ok", "dropped", "error")}
        print(f"requests        {args.requests} ({counts}), concurrency {args.concurrency}")
        print(f"duration        {duration:.1f} s, {args.requests / duration:.2f} requests/s")
        print(f"KV blocks total {blocks_total:.0f}")
        print(f"{'RSS (MB)':<14}{'at ' + str(rss_at):>10}{'at end':>10}{'growth':>10}")
        for name in samples["end"]:
            a = run["rss_first"].get(name, float("nan"))
            b = samples["end"][name]
            print(f"{name:<14}{a:>10.1f}{b:>10.1f}{b - a:>+10.1f}")
        checks = report(args, run)
        for name, ok, detail in checks:
            print(f"{'PASS' if ok else 'FAIL'}  {name:<16}{detail}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "requests": args.requests,
                        "concurrency": args.concurrency,
                        "duration_s": duration,
                        "requests_per_s": args.requests / duration,
                        "counts": counts,
                        "rss_mb": {"first": run["rss_first"], "end": run["rss_end"]},
                        "settle_s": settle_s,
                        "final": run["final"],
                        "checks": [{"name": n, "pass": ok, "detail": d} for n, ok, d in checks],
                    },
                    f,
                    indent=1,
                )
        return 0 if all(ok for _, ok, _ in checks) else 1
    finally:
        if server is not None:
            rc = server.stop()
            left = server.leftovers()
            print(f"soak: serve stopped (exit {rc}); leftovers: {left or 'none'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="", help="a running server (default: start one)")
    p.add_argument("--model", default="", help="model for the server we start (default model)")
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect-frac", type=float, default=0.2)
    p.add_argument("--constrained-frac", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-at", type=int, default=1000, help="first RSS sample after N requests")
    p.add_argument("--rss-bar-mb", type=float, default=64.0)
    p.add_argument("--settle-bar", type=float, default=5.0, help="seconds to get back to zero")
    p.add_argument("--out", default="", help="write the figures as JSON here")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.serve_args = argv[cut + 1 :]
    return run_soak(args)


if __name__ == "__main__":
    sys.exit(main())
