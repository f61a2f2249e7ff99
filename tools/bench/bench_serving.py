"""Serving benchmark: drive any OpenAI-compatible server over HTTP with a JSONL workload.

Each request is a streamed `/v1/completions` call (temperature 0, `ignore_eos`,
`max_tokens` from the workload), sent at its arrival offset, optionally under a cap on
requests in flight; requests with a `user` field run as closed loops, one per user.
TTFT is the time to the first chunk with text, ITL the gaps between chunks with text,
TPOT (e2e - TTFT) / (output tokens - 1). Output tokens come from the final usage chunk
when the server sends one, else from the number of chunks with text.

    python -m subway.tools.bench.bench_serving --base-url http://127.0.0.1:8000 \\
        --workload wl.jsonl --out result.json [--max-concurrency 16] \\
        [--slo-ttft-ms 1000 --slo-tpot-ms 100] [--metrics-url http://127.0.0.1:8000/metrics]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from collections import defaultdict
from typing import Any

import httpx
import numpy as np
import uvloop
from tqdm import tqdm

from subway.tools.bench.workload import (
    Request,
    add_workload_args,
    load_jsonl,
    workload_from_args,
)

SERVER_METRICS = (
    "subway:generation_tokens_total",
    "subway:prompt_tokens_total",
    "subway:time_to_first_token_seconds_count",
    "subway:time_to_first_token_seconds_sum",
    "subway:e2e_request_latency_seconds_count",
    "subway:e2e_request_latency_seconds_sum",
)


@dataclasses.dataclass
class Record:
    id: str
    prompt_tokens: int
    max_tokens: int
    start: float = 0.0  # seconds since the benchmark began
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = dataclasses.field(default_factory=list)
    usage_reported: bool = False

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclasses.dataclass
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, r: Record, request_ttft_ms: float | None = None) -> bool:
        """Per-request TTFT SLOs (from the workload) take precedence over the global one."""
        if not r.success:
            return False
        ttft = request_ttft_ms if request_ttft_ms is not None else self.ttft_ms
        if ttft is not None and r.ttft * 1e3 > ttft:
            return False
        if self.tpot_ms is not None and r.output_tokens > 1 and r.tpot * 1e3 > self.tpot_ms:
            return False
        return self.e2e_ms is None or r.e2e * 1e3 <= self.e2e_ms


def stats_ms(values: list[float]) -> dict[str, float]:
    """mean/p50/p90/p99 (and max) in milliseconds; NaNs are skipped."""
    a = np.asarray([v for v in values if not math.isnan(v)], dtype=float) * 1e3
    if a.size == 0:
        return {k: math.nan for k in ("mean", "p50", "p90", "p99", "max")}
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def compute_metrics(
    records: list[Record], duration: float, slo: Slo, requests: list[Request] | None = None
) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    slo_by_id = {q.id: q.slo_ttft_ms for q in requests or []}
    good = [r for r in ok if slo.met(r, slo_by_id.get(r.id))]
    d = max(duration, 1e-9)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": in_tok,
        "output_tokens": out_tok,
        "request_throughput": len(ok) / d,
        "output_throughput": out_tok / d,
        "total_token_throughput": (in_tok + out_tok) / d,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([r.tpot for r in ok]),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
        "slo": dataclasses.asdict(slo),
        "good_requests": len(good),
        "goodput": len(good) / d,
        "slo_attainment": len(good) / max(1, len(records)),
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
    }


async def send_one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    req: Request,
    rec: Record,
    t0: float,
    extra: dict[str, Any] | None = None,
    slo_fields: bool = False,
) -> None:
    """One streamed request; `extra` fields join its body (a constraint, say). With
    `slo_fields`, the request's `slo_class` and `slo_ttft_ms` join it too (where set)."""
    body = {
        "model": req.model or model,  # a request's own: a LoRA adapter's name
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if req.priority is not None:
        body["priority"] = req.priority
    if slo_fields:
        if req.slo_class is not None:
            body["slo_class"] = req.slo_class
        if req.slo_ttft_ms is not None:
            body["slo_ttft_ms"] = req.slo_ttft_ms
    body.update(extra or {})
    start = time.perf_counter()
    rec.start = start - t0
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if msg.get("error"):
                    rec.error = str(msg["error"])[:200]
                    return
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    rec.output_tokens = int(usage["completion_tokens"])
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
                    rec.usage_reported = True
                if any(c.get("text") for c in msg.get("choices") or ()):
                    if chunks == 0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
        rec.e2e = time.perf_counter() - start
        if not rec.usage_reported:
            rec.output_tokens = chunks
        rec.success = chunks > 0 or rec.output_tokens > 0
        if not rec.success:
            rec.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]


async def run_requests(
    base_url: str,
    requests: list[Request],
    model: str = "",
    max_concurrency: int = 0,
    timeout: float = 600.0,
    progress: bool = True,
    extra: dict[str, Any] | None = None,
    slo_fields: bool = False,
) -> tuple[list[Record], float]:
    """Send the workload; returns the per-request records and the wall time of the whole run.
    `slo_fields`: send each request's `slo_class` and `slo_ttft_ms` (Subway's fields)."""
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    records = [Record(q.id, q.prompt_tokens, q.max_tokens) for q in requests]
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        if not model:
            model = await server_model(client, base_url)
        t0 = time.perf_counter()

        async def one(q: Request, rec: Record) -> None:
            if sem is None:
                await send_one(client, url, model, q, rec, t0, extra, slo_fields)
            else:
                async with sem:
                    await send_one(client, url, model, q, rec, t0, extra, slo_fields)
            bar.update()

        async def timed(q: Request, rec: Record) -> None:
            await asyncio.sleep(max(0.0, t0 + q.arrival_s - time.perf_counter()))
            await one(q, rec)

        async def user_loop(items: list[tuple[Request, Record]]) -> None:
            for q, rec in items:
                await one(q, rec)

        users: dict[int, list[tuple[Request, Record]]] = defaultdict(list)
        tasks = []
        for q, rec in zip(requests, records, strict=True):
            if q.user is None:
                tasks.append(timed(q, rec))
            else:
                users[q.user].append((q, rec))
        tasks += [user_loop(items) for items in users.values()]
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return records, duration


async def server_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists, so that any OpenAI-compatible server works unconfigured."""
    try:
        r = await client.get(base_url.rstrip("/") + "/v1/models", timeout=10)
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


def parse_prometheus(text: str, names: tuple[str, ...] = SERVER_METRICS) -> dict[str, float]:
    """Sum each wanted metric over its label sets."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            try:
                out[name] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def scrape(url: str) -> dict[str, float] | None:
    try:
        return parse_prometheus(httpx.get(url, timeout=10).text)
    except httpx.HTTPError:
        return None


def server_agreement(
    before: dict[str, float], after: dict[str, float], m: dict[str, Any]
) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in before}
    n = d["subway:time_to_first_token_seconds_count"]
    return {
        "deltas": d,
        "generation_tokens": {
            "server": d["subway:generation_tokens_total"],
            "client": m["output_tokens"],
        },
        "ttft_mean_ms": {
            "server": d["subway:time_to_first_token_seconds_sum"] / n * 1e3 if n else math.nan,
            "client": m["ttft_ms"]["mean"],
        },
        "ttft_count": {"server": n, "client": m["completed"]},
    }


def benchmark(
    base_url: str,
    requests: list[Request],
    model: str = "",
    max_concurrency: int = 0,
    slo: Slo | None = None,
    metrics_url: str = "",
    timeout: float = 600.0,
    progress: bool = True,
    keep_records: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the workload against a server and return the result dict (what `--out` writes);
    `extra` fields join every request's body."""
    slo = slo or Slo()
    before = scrape(metrics_url) if metrics_url else None
    # uvloop, as the servers run: the client shares the machine with the server it measures,
    # and asyncio's own loop cost it about a fifth more CPU a streamed token (ad-hoc, c1).
    records, duration = uvloop.run(
        run_requests(base_url, requests, model, max_concurrency, timeout, progress, extra)
    )
    m = compute_metrics(records, duration, slo, requests)
    result: dict[str, Any] = {
        "base_url": base_url,
        "num_requests": len(requests),
        "max_concurrency": max_concurrency,
        "metrics": m,
    }
    if metrics_url:
        after = scrape(metrics_url)
        if before is not None and after is not None:
            result["server_metrics"] = server_agreement(before, after, m)
        else:
            result["server_metrics"] = {"error": f"could not scrape {metrics_url}"}
    errors = [r.error for r in records if r.error]
    if errors:
        result["errors"] = errors[:10]
    if keep_records:
        result["requests"] = [dataclasses.asdict(r) for r in records]
    return result


def format_table(result: dict[str, Any]) -> str:
    m = result["metrics"]
    rows = [
        ("completed / failed", f"{m['completed']} / {m['failed']}"),
        ("duration (s)", f"{m['duration_s']:.2f}"),
        ("prompt / output tokens", f"{m['prompt_tokens']} / {m['output_tokens']}"),
        ("request throughput (req/s)", f"{m['request_throughput']:.3f}"),
        ("output throughput (tok/s)", f"{m['output_throughput']:.1f}"),
        ("total throughput (tok/s)", f"{m['total_token_throughput']:.1f}"),
        ("goodput (req/s)", f"{m['goodput']:.3f} ({m['slo_attainment']:.0%} within SLO)"),
    ]
    lines = [f"{k:<30}{v}" for k, v in rows]
    lines.append(f"{'(ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = m[key]
        lines.append(
            f"{key[:-3].upper():<12}"
            + "".join(f"{s[q]:>10.1f}" for q in ("mean", "p50", "p90", "p99"))
        )
    sm = result.get("server_metrics")
    if sm and "deltas" in sm:
        for k in ("generation_tokens", "ttft_mean_ms", "ttft_count"):
            lines.append(f"server vs client {k:<18}{sm[k]['server']:.1f} vs {sm[k]['client']:.1f}")
    return "\n".join(lines)


def base_url(url: str) -> str:
    """A server's base URL as given (`http://host:port`, with or without `/v1`): the base."""
    return url.removesuffix("/").removesuffix("/v1")


def requests_from_args(a: argparse.Namespace) -> list[Request]:
    """`--workload FILE` (its first `--limit`), else the workload the workload flags make."""
    return load_jsonl(a.workload, a.limit) if a.workload else workload_from_args(a)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--workload",
        default="",
        help="JSONL from subway.tools.bench.workload (default: generate one from the "
        "workload flags below, the headline workload as given)",
    )
    p.add_argument("--limit", type=int, default=0, help="only the first N requests")
    p.add_argument("--model", default="", help="model name (default: the server's first)")
    p.add_argument("--max-concurrency", type=int, default=0, help="0: no cap")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--metrics-url", default="", help="Prometheus endpoint to diff before/after")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--no-records", action="store_true", help="leave per-request records out")
    p.add_argument("--extra-body", default="", help="JSON object added to every request body")
    p.add_argument("--out", default="", help="JSON result file")
    add_workload_args(p)
    a = p.parse_args(argv)
    result = benchmark(
        base_url(a.base_url),
        requests_from_args(a),
        a.model,
        a.max_concurrency,
        Slo(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_e2e_ms),
        a.metrics_url,
        a.timeout,
        keep_records=not a.no_records,
        extra=json.loads(a.extra_body) if a.extra_body else None,
    )
    print(format_table(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
