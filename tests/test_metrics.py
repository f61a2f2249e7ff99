"""`/metrics` (Prometheus, vLLM's names with a `subway:` prefix) and the access log, on a live server.

Counts are exact: each test reads the counters before and after what it does.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import TINY_FLAGS, until

MODEL = "tiny"

GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "batch_size",
    "step_last_seconds",
    "step_predicted_last_seconds",
)
COUNTERS = (
    "num_preemptions",
    "prefix_cache_hits",
    "prefix_cache_queries",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "pooling_limited_steps",
)
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


@pytest.fixture(scope="module")
def server(servers, tiny_models):
    return servers.get(tiny_models["llama"], *TINY_FLAGS)


def scrape(server) -> dict:
    """Families by name, and samples by `name{label=value,...}` (model_name and the one
    engine's labels left out); `engines`: the engine label of each engine-level sample."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    families, samples, engines = {}, {}, {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.type
        for s in family.samples:
            if "engine" in s.labels:
                engines[s.name] = s.labels["engine"]
            labels = ",".join(
                f"{k}={v}"
                for k, v in sorted(s.labels.items())
                if k not in ("model_name", "le", "engine", "role")
            )
            if "le" in s.labels:
                continue
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return {"families": families, "samples": samples, "engines": engines}


def value(m: dict, name: str) -> float:
    return m["samples"].get(f"subway:{name}", 0.0)


def test_names_and_types(server):
    m = scrape(server)
    types = m["families"]
    for g in GAUGES:
        assert types[f"subway:{g}"] == "gauge", g
    for c in COUNTERS:
        assert types[f"subway:{c}"] == "counter", c
    for h in HISTOGRAMS:
        assert types[f"subway:{h}"] == "histogram", h
    assert "subway:num_preemptions_total" in m["samples"]
    assert m["engines"]["subway:num_preemptions_total"] == "0"  # one engine: engine 0
    assert m["engines"]["subway:kv_cache_usage_perc"] == "0"
    assert "subway:request_success_total{finished_reason=length}" in m["samples"]
    assert "subway:request_success_total{finished_reason=stop}" in m["samples"]


def test_counts_are_exact(server):
    before = scrape(server)
    prompt = "Count the tokens of this prompt"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "ignore_eos": True}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(
                *(c.post(server.url + "/v1/completions", json=body) for _ in range(5)),
                *(
                    c.post(server.url + "/v1/completions", json={**body, "stream": True})
                    for _ in range(5)
                ),
            )
        return rs

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses)
    prompt_tokens = responses[0].json()["usage"]["prompt_tokens"]
    after = scrape(server)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("time_to_first_token_seconds_count") == 10
    assert delta("inter_token_latency_seconds_count") == 90
    assert delta("e2e_request_latency_seconds_count") == 10
    assert delta("request_queue_time_seconds_count") == 10
    assert delta("request_success_total{finished_reason=length}") == 10
    assert delta("generation_tokens_total") == 100
    assert delta("prompt_tokens_total") == 10 * prompt_tokens
    assert delta("time_to_first_token_seconds_sum") > 0
    assert value(after, "num_requests_running") == 0
    # The cost model's prediction for the last step sits beside its measured time.
    assert value(after, "step_last_seconds") > 0 and value(after, "step_predicted_last_seconds") > 0


def test_prefix_cache_counters_and_kv_usage(server):
    prompt = "shared prefix " * 24  # several full blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    before = scrape(server)
    for _ in range(2):
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    after = scrape(server)
    assert value(after, "prefix_cache_queries_total") > value(before, "prefix_cache_queries_total")
    assert value(after, "prefix_cache_hits_total") > value(before, "prefix_cache_hits_total")
    # A request that runs holds KV blocks; once it ends they count as free again.
    long = {**body, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=long) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break

        def holds_blocks() -> bool:
            m = scrape(server)
            return value(m, "kv_cache_usage_perc") * value(m, "num_requests_running") > 0

        until(holds_blocks, 2.0)
    assert _idle_within(server, 1.0)


def _idle_within(server, seconds: float) -> dict | None:
    deadline = time.monotonic() + seconds
    while True:
        m = scrape(server)
        if all(value(m, g) == 0 for g in GAUGES[:3]):
            return m
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def test_200_streaming_clients_disconnect(server):
    n = 200
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    streaming = 0

    async def run() -> None:
        nonlocal streaming
        all_in = asyncio.Event()
        go = asyncio.Event()
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:

            async def one() -> None:
                nonlocal streaming
                url = server.url + "/v1/chat/completions"
                async with c.stream("POST", url, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break
                    streaming += 1
                    if streaming == n:
                        all_in.set()
                    await go.wait()  # then leave: the connection closes mid-answer

            tasks = [asyncio.create_task(one()) for _ in range(n)]
            await asyncio.wait_for(all_in.wait(), 60)
            # A stream's first line (the role) leaves before the engine reports the request:
            # under load its gauges may lag it, so wait (bounded) for them to show the work.
            deadline = time.monotonic() + 10
            while True:
                m = scrape(server)
                live = value(m, "num_requests_running") + value(m, "num_requests_waiting")
                if live > 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            assert live > 0
            go.set()
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert streaming == n
    t0 = time.monotonic()
    assert _idle_within(server, 1.0) is not None, scrape(server)["samples"]
    assert time.monotonic() - t0 < 1.0 + 0.5
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "still there?", "max_tokens": 4},
        timeout=5,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def _access_lines(server) -> list[dict]:
    return [
        json.loads(line.split("subway.access INFO ", 1)[1])
        for line in server.read_output().splitlines()
        if "subway.access INFO " in line
    ]


def _bad_completions(lines: list[dict]) -> int:
    return sum(x["status"] == 400 and x["path"] == "/v1/completions" for x in lines)


def test_access_log_line_per_request(server):
    bad_before = _bad_completions(_access_lines(server))
    body = {"model": MODEL, "prompt": "log me", "max_tokens": 3, "ignore_eos": True}
    rid = httpx.post(server.url + "/v1/completions", json=body).json()["id"]
    bad = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": 5})
    assert bad.status_code == 400
    lines: list[dict] = []

    def both_logged() -> bool:  # each line is written once its response has ended
        lines[:] = _access_lines(server)
        return any(x.get("id") == rid for x in lines) and _bad_completions(lines) > bad_before

    until(both_logged, 5.0)
    mine = [x for x in lines if x.get("id") == rid]
    assert len(mine) == 1
    [x] = mine
    assert x["status"] == 200 and x["path"] == "/v1/completions"
    assert x["prompt_tokens"] > 0 and x["output_tokens"] == 3
    assert 0 < x["ttft_s"] <= x["latency_s"] and x["finish_reason"] == "length"
    assert _bad_completions(lines) == bad_before + 1
