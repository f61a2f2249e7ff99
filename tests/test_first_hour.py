"""A new user's first hour: `subway env`, `subway bench serve` and `compare`, and the lines
that say what a long step is doing (README, Quick start and "Reporting a bug")."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from subway.progress import Ticker
from subway.tools import env_report
from subway.tools.bench import url_compare

from serving import TINY_FLAGS, Server

CLI = [sys.executable, "-m", "subway.tools.cli"]


def test_subway_env_is_fast_imports_no_torch_and_names_each_kernel_path():
    code = (
        "import sys, time; t = time.monotonic(); from subway.tools.cli import main; "
        "main(['env', '--json']); "
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', time.monotonic() - t)"
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    wall = time.monotonic() - t0
    text, last = out.rsplit("\n", 2)[0], out.splitlines()[-1]
    assert last.startswith("NO TORCH"), last
    assert wall < 3.0  # the whole process, interpreter start included
    info = json.loads(text)
    assert info["packages"]["torch"] != "not installed"
    assert {k["op"] for k in info["kernels"]} >= {"decode attention (paged)", "8-bit KV cache"}
    assert info["cpu"]["cores"] >= 1 and info["serve_threads"] >= 1
    assert "Kernel path of each CPU op" in env_report.render(info)


@pytest.mark.parametrize(
    "flags,one_row,int8",
    [
        ("avx2 fma f16c", "AVX2 (its own weight layout)", "AVX2 int8 (exact int32 sums)"),
        ("avx2 fma f16c avx512f avx512_bf16 avx512_vnni", "AVX512-BF16 dot products",
         "AVX2 int8 (exact int32 sums)"),
        ("avx2 fma f16c avx512f avx512_bf16 amx_tile amx_bf16 amx_int8",
         "AVX512-BF16 dot products", "AMX int8 tiles"),
        ("sse4_2", "oneDNN (PyTorch)", "refused"),
    ],
)  # fmt: skip
def test_kernel_paths_follow_the_cpus_flags(flags, one_row, int8):
    cpu = env_report.read_cpu(f"model name\t: Some CPU\nflags\t\t: {flags}\n")
    assert cpu.model == "Some CPU"
    paths = {op: path for op, path, _ in env_report.kernel_paths(cpu)}
    assert paths["bfloat16 linear, 1 row (decode)"] == one_row
    assert paths["int8 linear (--quantization int8)"] == int8
    amx = "amx_tile" in flags
    assert paths["bfloat16 linear, few rows"].startswith("AMX") == amx
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "reference"
    assert paths["decode attention (paged)"].startswith(simd)


def test_a_ticker_speaks_only_for_a_long_block(capsys):
    with Ticker("doing a short thing", first=5.0):
        pass
    assert capsys.readouterr().err == ""
    spoke = threading.Event()
    with Ticker("doing a long thing", first=0.01, every=0.01) as ticker:
        deadline = time.monotonic() + 10
        while not spoke.is_set() and time.monotonic() < deadline:
            spoke.wait(0.01)  # paces the look at the ticker's output
            if ticker._thread.is_alive() and "still doing a long thing" in capsys.readouterr().err:
                spoke.set()
    assert spoke.is_set()


@pytest.fixture(scope="module")
def server(servers, tiny_models):
    return servers.get(tiny_models["llama"], *TINY_FLAGS)


def _workload_flags(n: int) -> list[str]:
    return ["--num-requests", str(n), "--mean-prompt-tokens", "24", "--max-prompt-tokens", "48",
            "--min-output-tokens", "4", "--max-output-tokens", "8"]  # fmt: skip


def test_bench_serve_is_bench_serving_with_a_command(server, tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run(
        [*CLI, "bench", "serve", "--base-url", server.url + "/v1", *_workload_flags(6),
         "--out", str(out), "--no-records"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "output throughput (tok/s)" in run.stdout
    m = json.loads(out.read_text())["metrics"]
    assert m["completed"] == 6 and m["failed"] == 0
    from subway.tools.bench import workload

    # The same flags and seed give the same requests: their output lengths, summed.
    wanted = workload.generate(
        workload.load_tokenizer(""), num_requests=6, mean_prompt_tokens=24,
        max_prompt_tokens=48, min_output_tokens=4, max_output_tokens=8,
    )  # fmt: skip
    assert m["output_tokens"] == sum(r.max_tokens for r in wanted)


def test_bench_compare_alternates_two_urls_and_prints_each_rounds_ratio(server, capsys):
    url_compare.main(["--a", server.url, "--b", server.url + "/v1", "--rounds", "2",
                      *_workload_flags(3)])  # fmt: skip
    text = capsys.readouterr().out
    rows = [
        line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    assert len(rows) == 2
    ratios = [float(r.split("|")[4]) for r in rows]
    assert all(r.split("|")[7].strip() == "0 / 0" for r in rows)  # failed A / B
    assert all(r > 0 for r in ratios) and "throughput B/A: median" in text


def test_a_server_in_a_with_block_stops_when_the_block_raises(tiny_models):
    with pytest.raises(RuntimeError, match="the script failed"):
        with Server(tiny_models["llama"], *TINY_FLAGS) as server:
            raise RuntimeError("the script failed")
    assert server.proc.poll() == 0 and not server.leftovers()


def test_each_environment_and_checkout_builds_the_kernels_in_a_folder_of_its_own(
    monkeypatch, tmp_path
):
    from subway import cache_dir
    from subway.kernels import cpu_ext

    monkeypatch.setenv("SUBWAY_CACHE", str(tmp_path))
    here = cache_dir.kernel_build_dir("/a/checkout/csrc")
    assert here == cache_dir.kernel_build_dir("/a/checkout/csrc")
    assert here.startswith(str(tmp_path / "ext"))
    assert cache_dir.kernel_build_dir("/another/checkout/csrc") != here
    assert env_report.built_kernels()["folder"] == cpu_ext._build_dir()  # env looks there
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    assert cache_dir.kernel_build_dir("/a/checkout/csrc") != here


def test_free_ports_lie_below_the_ephemeral_range():
    """Ports the kernel gives outgoing connections never collide with a test server's:
    free_port picks below that range (a start once failed on "Address already in use")."""
    from subway.tools.serve_process import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(10_000 <= p < low for p in ports) and len(ports) > 1


def test_a_starting_serve_says_what_it_waits_for_in_plain_words():
    from subway.tools.launch import _waiting_for

    assert "waiting for the frontend" in _waiting_for("no answer on /tmp/x/live.sock (gone)")
    assert _waiting_for("engine not ready").endswith("(loading the model)")
    assert _waiting_for("engine silent").endswith("(engine silent)")
