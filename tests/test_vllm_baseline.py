"""The vLLM baseline driver (tools/bench/vs_vllm.py) without vLLM: run order, the server
command, the settings, the ratios, the token-count check, and one measurement against a
fake streaming server."""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from subway.tools.bench import vs_vllm
from subway.tools.bench.workload import Request
from subway.tools.cli import add_engine_args, config_from_args


def test_order_alternates_abba() -> None:
    assert vs_vllm.order(1) == ["subway", "vllm"]
    assert vs_vllm.order(2) == ["subway", "vllm", "vllm", "subway"]
    assert vs_vllm.order(3)[4:] == ["subway", "vllm"]


def test_vllm_command_serves_the_folder_without_prefix_cache() -> None:
    cmd = vs_vllm.vllm_command("s.sh", "/models/m", 1234, ["--max-num-batched-tokens", "512"])
    assert cmd[:5] == ["bash", "s.sh", "serve", "/models/m", "1234"]
    assert "--no-enable-prefix-caching" in cmd
    assert cmd[-2:] == ["--max-num-batched-tokens", "512"]  # the caller's args come last
    assert "--no-prefix-caching" in vs_vllm.ENGINE_FLAGS  # and Subway alike


def test_subway_args_come_after_engine_flags_and_win() -> None:
    flags = vs_vllm.subway_flags("--max-num-batched-tokens 2048")
    assert flags[: len(vs_vllm.ENGINE_FLAGS)] == vs_vllm.ENGINE_FLAGS
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args(flags))
    assert config.scheduler.max_num_batched_tokens == 2048  # ENGINE_FLAGS say 512
    assert vs_vllm.subway_flags("") == vs_vllm.ENGINE_FLAGS
    assert vs_vllm.subway_flags("--served-model-name 'a b'")[-1] == "a b"  # quoted as in a shell


def test_settings_end_with_single_stream() -> None:
    assert vs_vllm.settings([64, 16], 8) == [("c64", 64, 0), ("c16", 16, 0), ("c1", 1, 8)]
    assert vs_vllm.settings([64], 0) == [("c64", 64, 0)]


def _run(tput: float, itl_p50: float, tokens: list[int]) -> dict[str, Any]:
    m = {
        "output_throughput": tput,
        "ttft_ms": {"p50": 1.0, "p99": 2.0},
        "itl_ms": {"p50": itl_p50, "p99": 2 * itl_p50},
        "output_tokens": sum(tokens),
        "per_request_tokens": tokens,
        "foreign_cores_during": 0.1,
    }
    return {"c64": m, "c1": m}


def test_ratios_use_the_median_round() -> None:
    runs = {
        "subway": [_run(300, 20, [4, 5]), _run(100, 30, [4, 5]), _run(330, 21, [4, 5])],
        "vllm": [_run(200, 40, [4, 5]), _run(250, 42, [4, 5]), _run(240, 60, [4, 5])],
    }
    r = vs_vllm.ratios(runs, ["c64", "c1"])
    assert r["throughput_c64"] == pytest.approx(300 / 240)
    assert r["itl_p50_c1_lower"] == pytest.approx(42 / 21)
    assert vs_vllm.token_agreement(runs, ["c64"]) == {"c64": True}
    runs["vllm"][1] = _run(250, 42, [4, 6])
    assert vs_vllm.token_agreement(runs, ["c64"]) == {"c64": False}
    text = vs_vllm.table(runs, ["c64"])
    assert "| c64 | vllm | 2 | 250.0 | 1 / 2 | 42.0 / 84.0 | 10 | 0.10 |" in text


class _FakeServer(BaseHTTPRequestHandler):
    """Streams `max_tokens` one-token chunks when `ignore_eos`, else stops after two."""

    bodies: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._json({"data": [{"id": "fake"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        n = body["max_tokens"] if body.get("ignore_eos") else min(2, body["max_tokens"])
        if not body.get("stream"):
            self._json({"choices": [{"text": "x" * n}], "usage": {"completion_tokens": n}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(n):
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 3}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def _json(self, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_measure_sends_greedy_ignore_eos_and_counts_tokens(monkeypatch) -> None:
    warm = [Request("w", "warm", 1, 3)]
    monkeypatch.setattr(vs_vllm.compare, "warmup_requests", lambda: warm)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reqs = [Request(f"r{i}", f"p{i}", 1, 5 + i) for i in range(4)]
        floors = iter([{"ms": 10.0}, {"ms": 14.0}])
        out = vs_vllm.measure(
            url, reqs, vs_vllm.settings([4], 2), max_cores=99.0, floor=lambda: next(floors)
        )
    finally:
        server.shutdown()
    # The floor is read around the single-stream setting only, and its ITL divided by their mean.
    assert "read_floor_around" not in out["c4"]
    assert out["c1"]["read_floor_around"] == [{"ms": 10.0}, {"ms": 14.0}]
    assert out["c1"]["itl_over_floor"] == pytest.approx(out["c1"]["itl_ms"]["p50"] / 12.0)
    assert out["c4"]["per_request_tokens"] == [5, 6, 7, 8]
    assert out["c4"]["output_tokens"] == 26 and out["c4"]["usage_reported"]
    assert out["c1"]["per_request_tokens"] == [5, 6]
    assert out["greedy_text"] == "x" * 32
    assert all(b["temperature"] == 0.0 and b["ignore_eos"] for b in _FakeServer.bodies)


def test_interleave_runs_each_setting_on_both_servers_abba(monkeypatch) -> None:
    """`--interleave`: one warm-up per server, then per round each setting on one server and
    then the other, the order reversed in the second round; results land in their round."""
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(vs_vllm, "warm_up", lambda url, reqs: {"greedy_text": url})

    def fake(url: str, reqs: list, setting: tuple, max_cores: float, wait_s: float, floor) -> dict:
        calls.append((url, setting[0]))
        return {"n": len(calls)}

    monkeypatch.setattr(vs_vllm, "measure_setting", fake)
    plan = [("c64", 64, 0), ("c1", 1, 8)]
    runs = vs_vllm.interleaved({"subway": "S", "vllm": "V"}, [], plan, 2, 0.3, 1.0)
    assert calls == [
        ("S", "c64"), ("V", "c64"), ("S", "c1"), ("V", "c1"),
        ("V", "c64"), ("S", "c64"), ("V", "c1"), ("S", "c1"),
    ]  # fmt: skip
    assert [r["c64"]["n"] for r in runs["subway"]] == [1, 6]
    assert [r["c1"]["n"] for r in runs["vllm"]] == [4, 7]
    assert all(r["greedy_text"] == "V" for r in runs["vllm"]) and len(runs["subway"]) == 2


def test_read_floor_reads_as_many_bytes_as_the_model_has(tiny_models) -> None:
    """The weight-read floor counts every stored tensor once and reads that many bytes."""
    from transformers import AutoModelForCausalLM

    from subway.tools.bench import read_floor

    path = tiny_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(path)
    stored = {p.data_ptr(): p.numel() for p in model.state_dict().values()}  # tied: once
    assert read_floor.weight_elements(path) == sum(stored.values())
    out = read_floor.measure(1 << 20, torch.bfloat16, threads=1, rounds=3)
    assert out["bytes"] == 2 << 20 and out["ms"] > 0
    assert out["gbps"] == pytest.approx(out["bytes"] / out["ms"] / 1e6)
    # Read as bfloat16 and as float32 (the same bytes); the floor is the faster read.
    assert set(out["ms_by_view"]) == {"bfloat16", "float32"}
    assert out["ms"] == min(out["ms_by_view"].values())


def test_single_stream_itl_is_divided_by_the_floor_read_around_it(monkeypatch) -> None:
    """The floor is read just before and after a c1 run (not around others), and the run's
    ITL p50 is divided by the mean of those two readings."""
    events: list[str] = []
    metrics = {
        "output_throughput": 50.0, "ttft_ms": {}, "itl_ms": {"p50": 18.0}, "tpot_ms": {},
        "completed": 1, "failed": 0, "output_tokens": 4, "usage_reported": True,
    }  # fmt: skip

    def bench(*args: Any, **kw: Any) -> dict[str, Any]:
        events.append("run")
        return {"metrics": metrics, "requests": [{"output_tokens": 4}]}

    def floor() -> dict[str, float]:
        events.append("floor")
        return {"ms": 10.0 if events.count("floor") % 2 else 14.0}

    monkeypatch.setattr(vs_vllm.bench_serving, "benchmark", bench)
    monkeypatch.setattr(vs_vllm, "wait_for_quiet", lambda max_cores, within_s: 0.0)
    reqs = [Request("r", "p", 1, 4)]
    many = vs_vllm.measure_setting("u", reqs, ("c4", 4, 0), floor=floor)
    assert events == ["run"] and "itl_over_floor" not in many
    one = vs_vllm.measure_setting("u", reqs, ("c1", 1, 1), floor=floor)
    assert events == ["run", "floor", "run", "floor"]
    assert [f["ms"] for f in one["read_floor_around"]] == [10.0, 14.0]
    assert one["itl_over_floor"] == pytest.approx(18.0 / 12.0)
