"""tools/bench/goodput.py without a server or a model: the mixed workload, the per-run
metrics from synthetic records, the goodput interpolation, the table and the plot."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re

import httpx
import numpy as np
import pytest

from subway.tools.bench import bench_serving, goodput
from subway.tools.bench.bench_serving import Record
from subway.tools.bench.goodput import Mix
from subway.tools.bench.workload import Request, TextBuilder


class StubBuilder:
    """Text of exactly `target` one-letter words, drawn from the rng (so draws count)."""

    def build(self, rng: np.random.Generator, target: int) -> tuple[str, int]:
        return " ".join("abcdefgh"[int(i)] for i in rng.integers(0, 8, target)), target


class WordTokenizer:
    """One token per word or punctuation mark."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(t) % 1000 for t in re.findall(r"\w+|[^\w\s]", text)]


SMALL = Mix(batch_jobs=8, chats=20)


def build(mix: Mix = SMALL, rate: float = 2.0) -> list[Request]:
    return goodput.make_workload(StubBuilder(), mix, rate)


def chats(reqs: list[Request]) -> list[Request]:
    return [r for r in reqs if r.slo_class == "interactive"]


def batch(reqs: list[Request]) -> list[Request]:
    return [r for r in reqs if r.slo_class == "batch"]


# ---------------------------------------------------------------- workload


def test_workload_deterministic_by_seed() -> None:
    assert build() == build()
    assert build() != build(dataclasses.replace(SMALL, seed=1))


def test_workload_counts_classes_and_slo_fields() -> None:
    reqs = build()
    assert len(reqs) == 28 and len({r.id for r in reqs}) == 28
    for r in chats(reqs):
        assert (r.priority, r.slo_ttft_ms) == (0, SMALL.slo_ttft_ms)
        assert 32 <= r.prompt_tokens <= 256 and 16 <= r.max_tokens <= 64
        assert r.arrival_s > SMALL.chat_start
    for r in batch(reqs):
        assert (r.priority, r.slo_ttft_ms, r.max_tokens) == (1, None, 256)
        assert 256 <= r.prompt_tokens <= 768
    assert len(chats(reqs)) == 20 and len(batch(reqs)) == 8
    t = [r.arrival_s for r in reqs]
    assert t == sorted(t)


def test_workload_with_a_real_text_builder() -> None:
    reqs = goodput.make_workload(TextBuilder(WordTokenizer()), SMALL, 3.0)
    assert all(r.prompt_tokens == len(WordTokenizer().encode(r.prompt)) for r in reqs)
    assert all(32 <= r.prompt_tokens <= 256 for r in chats(reqs))


def test_chat_arrivals_scale_with_one_over_rate() -> None:
    slow, fast = chats(build(rate=1.0)), chats(build(rate=4.0))
    s = np.array([r.arrival_s for r in slow]) - SMALL.chat_start
    f = np.array([r.arrival_s for r in fast]) - SMALL.chat_start
    np.testing.assert_allclose(f * 4.0, s, atol=1e-5)
    strip = [dataclasses.replace(r, arrival_s=0.0) for r in slow]
    assert strip == [dataclasses.replace(r, arrival_s=0.0) for r in fast]
    mean_gap = np.diff(np.array([r.arrival_s for r in chats(build(Mix(chats=2000), 5.0))])).mean()
    assert mean_gap == pytest.approx(0.2, rel=0.1)  # Poisson at the rate


def test_batch_together_and_steady() -> None:
    assert all(r.arrival_s == 0.0 for r in batch(build()))
    steady = build(dataclasses.replace(SMALL, batch_arrival="steady"))
    t = np.array([r.arrival_s for r in batch(steady)])
    last_chat = max(r.arrival_s for r in chats(steady))
    assert t[0] == pytest.approx(SMALL.chat_start) and t[-1] < last_chat
    np.testing.assert_allclose(np.diff(t), (last_chat - SMALL.chat_start) / 8, atol=1e-5)
    with pytest.raises(ValueError):
        build(dataclasses.replace(SMALL, batch_arrival="sometimes"))
    with pytest.raises(ValueError):
        build(rate=0.0)


def test_chat_stream_does_not_depend_on_batch_parameters() -> None:
    other = dataclasses.replace(
        SMALL, batch_jobs=3, batch_prompt=(100, 200), batch_output=7, batch_arrival="steady"
    )
    assert chats(build()) == chats(build(other))
    assert batch(build()) != batch(build(other))


# ---------------------------------------------------------------- metrics


def rec(rid: str, ttft: float, e2e: float, tokens: int, start: float = 0.0, ok: bool = True):
    return Record(rid, 10, tokens, start=start, success=ok, output_tokens=tokens if ok else 0,
                  ttft=ttft, e2e=e2e)  # fmt: skip


def test_point_metrics_attainment_and_batch() -> None:
    reqs = [
        Request("chat-0", "", 10, 11, 1.0, 0, "interactive", 500.0),
        Request("chat-1", "", 10, 11, 1.1, 0, "interactive", 500.0),
        Request("chat-2", "", 10, 11, 1.2, 0, "interactive", 500.0),
        Request("chat-3", "", 10, 11, 1.3, 0, "interactive", 500.0),
        Request("chat-4", "", 10, 1, 1.4, 0, "interactive", 500.0),
        Request("batch-0", "", 10, 100, 0.0, 1, "batch"),
        Request("batch-1", "", 10, 100, 0.0, 1, "batch"),
        Request("batch-2", "", 10, 100, 0.5, 1, "batch"),
    ]
    records = [
        rec("chat-0", 0.2, 0.2 + 10 * 0.05, 11),  # meets both
        rec("chat-1", 0.6, 0.6 + 10 * 0.05, 11),  # TTFT miss
        rec("chat-2", 0.2, 0.2 + 10 * 0.15, 11),  # TPOT miss
        rec("chat-3", math.nan, math.nan, 11, ok=False),  # failed: a miss
        rec("chat-4", 0.3, 0.3, 1),  # one token: TTFT only
        rec("batch-0", 1.0, 9.0, 100, start=0.0),
        rec("batch-1", 1.0, 11.0, 100, start=0.01),
        rec("batch-2", math.nan, math.nan, 100, start=0.5, ok=False),
    ]
    m = goodput.point_metrics(reqs, records, 500.0, 100.0)
    assert (m["chats"], m["chats_met"], m["chats_failed"]) == (5, 2, 1)
    assert m["attainment"] == pytest.approx(0.4)
    assert m["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert m["tpot_ms"]["p50"] == pytest.approx(50.0)
    assert (m["batch_jobs"], m["batch_failed"], m["batch_output_tokens"]) == (3, 1, 200)
    assert m["batch_completion_s"] == pytest.approx(11.01)
    assert m["batch_tokens_per_s"] == pytest.approx(200 / 11.01)


def test_point_metrics_without_a_finished_batch_job() -> None:
    reqs = [Request("batch-0", "", 10, 100, 0.0, 1, "batch")]
    m = goodput.point_metrics(reqs, [rec("batch-0", 0, 0, 0, ok=False)], 500.0, 100.0)
    assert math.isnan(m["batch_tokens_per_s"]) and m["batch_failed"] == 1
    assert math.isnan(m["attainment"])


# ---------------------------------------------------------------- goodput


def test_goodput_interpolates_between_last_pass_and_first_fail() -> None:
    assert goodput.goodput([(4.0, 0.5), (1.0, 1.0), (2.0, 0.95)]) == pytest.approx(
        (2.0 + 0.05 / 0.45 * 2.0, "")
    )
    assert goodput.goodput([(1.0, 1.0), (2.0, 0.9), (3.0, 0.7)]) == pytest.approx((2.0, ""))
    # A rate passing again above the first failure is not looked at.
    assert goodput.goodput([(1, 1.0), (2, 0.8), (3, 0.95)]) == pytest.approx((1.5, ""))


def test_goodput_edges() -> None:
    assert goodput.goodput([(1.0, 1.0), (8.0, 0.92)]) == (8.0, ">=")
    assert goodput.goodput([(1.0, 0.5), (2.0, 0.2)]) == (0.0, "<")
    assert goodput.goodput([(3.0, math.nan)]) == (0.0, "<")  # no chats counts as a miss
    assert goodput.goodput_text(0.0, "<", [2.0, 4.0]) == "< 2 chats/s"
    assert goodput.goodput_text(8.0, ">=", [2.0, 8.0]) == ">= 8.00 chats/s"
    assert math.isnan(goodput.goodput([])[0])


# ---------------------------------------------------------------- systems, counters, output


def test_parse_systems_and_vllm_priority() -> None:
    assert goodput.parse_systems(list(goodput.ALL_SYSTEMS))[-1] == ("vllm", "priority")
    for bad in ("vllm:edf", "subway:nope", "tgi:fcfs", "subway"):
        with pytest.raises(ValueError):
            goodput.parse_systems([bad])
    reqs = build()
    assert all(r.priority is None for r in goodput.for_system(reqs, "vllm", "fcfs"))
    assert goodput.for_system(reqs, "vllm", "priority") == reqs
    assert goodput.for_system(reqs, "subway", "fcfs") == reqs


def test_counters_picks_preempt_slo_chunk_totals() -> None:
    text = "\n".join([
        "# HELP subway:num_preemptions_total Preemptions by recompute.",
        "# TYPE subway:num_preemptions_total counter",
        'subway:num_preemptions_total{engine="0"} 3.0',
        'subway:num_preemptions_total{engine="1"} 2.0',
        "subway:slo_waits_total 7.0",
        "subway:chunk_capped_steps_total 1.0",
        "subway:num_steps_total 99.0",
        "subway:slo_something_bucket 5.0",
    ])  # fmt: skip
    assert goodput.counters(text) == {
        "subway:chunk_capped_steps_total": 1.0,
        "subway:num_preemptions_total": 5.0,
        "subway:slo_waits_total": 7.0,
    }


def point(rate: float, att: float) -> dict:
    stats = {"p50": 100.0, "p99": 200.0}
    return {"rate": rate, "attainment": att, "ttft_ms": stats, "tpot_ms": stats,
            "batch_tokens_per_s": 50.0, "batch_completion_s": 30.0, "chats_failed": 0,
            "batch_failed": 0, "counters": {"subway:num_preemptions_total": 4.0}}  # fmt: skip


def test_table_and_plot(tmp_path) -> None:
    systems = {"subway:edf": {"points": [point(2, 1.0), point(4, 0.8)]},
               "vllm:fcfs": {"points": [point(2, 0.5)]}}  # fmt: skip
    t = goodput.table(systems)
    assert t.count("\n") == 4 and "| subway:edf | 4 | 80% |" in t
    assert "num_preemptions_total 4" in t
    path = goodput.plot(systems, str(tmp_path / "img" / "goodput.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_presets_and_overrides() -> None:
    mix, rates = goodput.mix_from_args(goodput.parser().parse_args(["--mix", "heavy"]))
    assert (mix.batch_jobs, mix.batch_output, mix.chats, rates) == (48, 256, 60, [6.0])
    assert (mix.slo_ttft_ms, mix.slo_tpot_ms, mix.batch_arrival) == (500.0, 100.0, "together")
    a = goodput.parser().parse_args(["--mix", "light", "--rates", "1", "3", "--batch-jobs", "5"])
    mix, rates = goodput.mix_from_args(a)
    assert (mix.batch_jobs, rates) == (5, [1.0, 3.0])
    mix, rates = goodput.mix_from_args(goodput.parser().parse_args(["--mix", "light"]))
    assert (mix.batch_jobs, rates) == (24, [4.0])


def test_send_one_adds_slo_fields_only_when_asked() -> None:
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunk = {"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    async def send(q: Request, slo_fields: bool) -> Record:
        r = Record(q.id, q.prompt_tokens, q.max_tokens)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            await bench_serving.send_one(c, "http://x/v1/completions", "m", q, r, 0.0,
                                         slo_fields=slo_fields)  # fmt: skip
        return r

    chat = chats(build())[0]
    assert asyncio.run(send(chat, True)).success
    asyncio.run(send(chat, False))
    asyncio.run(send(batch(build())[0], True))
    assert (bodies[0]["slo_class"], bodies[0]["slo_ttft_ms"], bodies[0]["priority"]) == (
        "interactive", 500.0, 0
    )  # fmt: skip
    assert "slo_class" not in bodies[1] and bodies[1]["priority"] == 0
    assert bodies[2]["slo_class"] == "batch" and "slo_ttft_ms" not in bodies[2]
