"""The runtime: overlap, tensor parallelism through `serve`, per-process launch, and faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from subway.ipc.config import EngineConfig
from subway.ipc.messages import SamplingParams
from subway.llm import LLM, Output
from subway.tools.proc_title import parse

from reference import hf_greedy
from serving import Server, free_port, until

# ----------------------------------------------------------------------------- overlap


def _overlap_run(config, prompts, stop_ids, overlap):
    eng = LLM(config)
    ids = [
        eng.add(p, SamplingParams(max_tokens=12 + i, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    stop_rid = eng.add(prompts[3], SamplingParams(max_tokens=20, stop_token_ids=stop_ids,
                                                 temperature=0.0))  # fmt: skip
    out: dict[str, Output] = {}
    eng.run(out, overlap=overlap, abort_after={ids[2]: 3, ids[7]: 1})
    return {rid: (o.token_ids, o.finish_reason) for rid, o in out.items()}, ids, stop_rid


def test_overlap_equals_sync_with_stops_aborts_and_chunks(tiny_models):
    """The same requests and aborts: overlapped and synchronous loops give the same tokens."""
    config = EngineConfig.build(
        path=tiny_models["llama"], max_num_batched_tokens=40, num_kv_blocks=80, max_num_seqs=8
    )
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(5 + 23 * i)] for i in range(10)]
    probe, ids, _ = _overlap_run(config, prompts, [], overlap=False)
    stop_ids = [probe[ids[3]][0][5]]  # a token request 3 produces: the stop request ends on it
    sync, ids, stop_rid = _overlap_run(config, prompts, stop_ids, overlap=False)
    over, _, _ = _overlap_run(config, prompts, stop_ids, overlap=True)
    assert sync[stop_rid][1] == "stop" and sync[stop_rid][0][-1] == stop_ids[0]
    assert sync[ids[5]][1] == "length"
    for rid in over:
        if rid in (ids[2], ids[7]):  # aborted: overlap may have had one more token in flight
            assert over[rid][1] == sync[rid][1] == "abort"
            n = len(sync[rid][0])
            assert over[rid][0][:n] == sync[rid][0][: len(over[rid][0])]
            continue
        assert over[rid] == sync[rid], rid


# ------------------------------------------------------------------ tensor parallelism


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_tensor_parallel_serve_equals_transformers(tiny_models, arch):
    from transformers import AutoTokenizer

    s = Server(tiny_models[arch], "--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        assert sorted(parse(c.cmdline())["kind"] for c in s.children()) == [
            "frontend", "scheduler", "worker", "worker",
        ]  # fmt: skip
        tok = AutoTokenizer.from_pretrained(tiny_models[arch])
        for prompt in ("Tensor parallel ranks share", "one two three four five six"):
            r = httpx.post(
                s.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
                timeout=60,
            )
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            assert r.json()["choices"][0]["text"] == tok.decode(
                hf_greedy(tiny_models[arch], ids, 10).tokens
            )
    finally:
        assert s.stop() == 0
        assert s.shm_files() == []


# --------------------------------------------------------------- per-process launch


def test_processes_started_one_by_one_over_tcp(tiny_models, tmp_path):
    """As a two-host deployment would: tcp addresses (CurveZMQ with a key file made by
    `subway keygen`), ids inline, each process its own command."""
    ports = [free_port() for _ in range(4)]
    http = free_port()
    key_file = str(tmp_path / "engine.key")
    cli = [sys.executable, "-m", "subway.tools.cli"]
    subprocess.run([*cli, "keygen", key_file], check=True, timeout=60)
    flags = [
        "--curve-key-file", key_file,
        "--model", tiny_models["llama"], "--run-id", f"pp{ports[0]}", "--no-shm",
        "--scheduler-addr", f"tcp://127.0.0.1:{ports[0]}",
        "--frontend-addr", f"tcp://127.0.0.1:{ports[1]}",
        "--plan-addr", f"tcp://127.0.0.1:{ports[2]}",
        "--result-addr", f"tcp://127.0.0.1:{ports[3]}",
        "--dist-init-addr", f"127.0.0.1:{free_port()}",
        "--port", str(http), "--num-kv-blocks", "64",
    ]  # fmt: skip
    procs = [
        subprocess.Popen([*cli, "scheduler", *flags]),
        subprocess.Popen([*cli, "worker", "--rank", "0", *flags]),
        subprocess.Popen([*cli, "frontend", *flags]),
    ]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs)
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # bounded wait for readiness
        r = httpx.post(
            f"http://127.0.0.1:{http}/v1/completions",
            json={"prompt": "Hello there", "max_tokens": 5, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert not [f for f in os.listdir("/dev/shm") if f"pp{ports[0]}" in f]
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(30) for p in procs]
    assert codes == [0, 0, 0]


# --------------------------------------------------------------------------- faults


def _load(server: Server):
    """A coroutine function: one long streaming request, returning the text it got."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)

    async def one(i: int):
        text = ""
        stream = await client.completions.create(
            model="x", prompt=f"load {i} " * 10, max_tokens=2000,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    return one


@pytest.mark.parametrize(
    "victim",
    ["worker", *(pytest.param(v, marks=pytest.mark.slow) for v in ("scheduler", "frontend"))],
)
def test_kill_9_during_load(tiny_models, victim):
    s = Server(tiny_models["llama"], "--served-model-name", "x", "--num-kv-blocks", "256",
               "--max-model-len", "2048")  # fmt: skip
    pids = [c.pid for c in s.children()]
    one = _load(s)

    async def run():
        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        # Wait until tokens flow, then kill.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and s.metrics().get("subway:num_requests_running", 0) < 1:
            await asyncio.sleep(0.1)
        s.child(victim).kill()
        t0 = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, time.monotonic() - t0

    results, took = asyncio.run(run())
    # Every in-flight request ended (with an error, or cut short), within the bound.
    assert took < 15, took
    assert all(isinstance(r, Exception) or len(r) < 2000 * 8 for r in results)
    code = s.proc.wait(30)
    assert code != 0
    log = s.read_output()
    assert f"{victim}" in log and "exited" in log
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert s.shm_files() == []


def _start_one_by_one(model: str, run_id: str) -> tuple[list[subprocess.Popen], str]:
    http = free_port()
    flags = ["--model", model, "--run-id", run_id, "--port", str(http), "--num-kv-blocks", "256",
             "--max-model-len", "2048", "--dist-init-addr", f"127.0.0.1:{free_port()}"]  # fmt: skip
    cli = [sys.executable, "-m", "subway.tools.cli"]
    procs = [
        subprocess.Popen([*cli, kind, *flags, *(["--rank", "0"] if kind == "worker" else [])])
        for kind in ("scheduler", "worker", "frontend")
    ]
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs)
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return procs, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # bounded wait for readiness
    raise AssertionError("not healthy")


@pytest.mark.parametrize("victim", ["worker", pytest.param("scheduler", marks=pytest.mark.slow)])
def test_survivors_notice_a_dead_process_without_a_launcher(tiny_models, victim):
    """No `serve` supervising: the processes themselves notice a death and say so."""
    run_id = f"f{victim[0]}{free_port()}"
    procs, url = _start_one_by_one(tiny_models["llama"], run_id)
    scheduler, worker, frontend = procs
    ended: list[object] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                "prompt": "long " * 8, "max_tokens": 1900, "ignore_eos": True, "stream": True,
            }) as r:  # fmt: skip
                ended.append("\n".join(r.iter_lines()))
        except httpx.HTTPError as e:
            ended.append(e)

    import threading

    t = threading.Thread(target=stream)
    t.start()
    try:
        until(lambda: httpx.get(url + "/metrics").text.count("num_requests_running") > 0, 30)
        (worker if victim == "worker" else scheduler).kill()

        def health() -> int:
            return httpx.get(url + "/health", timeout=1).status_code

        assert until(lambda: health() == 503, 1.5) < 1.5  # "within a second", plus CI noise
        t.join(10)
        assert not t.is_alive(), "the in-flight request hung"
        # It ended with an error event (or a broken connection), not a finished answer.
        assert ended and (isinstance(ended[0], Exception) or '"error"' in ended[0])
        survivor = scheduler if victim == "worker" else worker
        assert survivor.wait(10) == 1  # it noticed, said so, and exited with an error
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    assert frontend.returncode == 0
    assert until(lambda: not [f for f in os.listdir("/dev/shm") if run_id in f], 5) < 5


@pytest.mark.parametrize("timeout", [1.0, pytest.param(0.0, marks=pytest.mark.slow)])
def test_sigterm_drains_then_aborts(tiny_models, timeout):
    """SIGTERM: new requests get 503, in-flight ones may finish for --shutdown-timeout
    seconds, the rest end with finish_reason "abort", and everything exits cleanly."""
    s = Server(tiny_models["llama"], "--shutdown-timeout", str(timeout), "--num-kv-blocks", "256",
               "--max-model-len", "2048")  # fmt: skip
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
            "prompt": "drain " * 8, "max_tokens": 1900, "ignore_eos": True, "stream": True,
        }) as r:  # fmt: skip
            lines.extend(r.iter_lines())

    import threading

    t = threading.Thread(target=stream)
    t.start()
    until(lambda: s.metrics().get("subway:num_requests_running", 0) >= 1, 30)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    if timeout > 0:  # while it drains: no new work, and /health says so
        until(lambda: httpx.get(s.url + "/health").status_code == 503, 2)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"]
    t.join(30)
    assert not t.is_alive()
    assert s.proc.wait(30) == 0
    assert time.monotonic() - t0 < timeout + 8
    last = [json.loads(x[6:]) for x in lines if x.startswith("data: {")][-1]
    assert last["choices"][0]["finish_reason"] == "abort"
    assert s.shm_files() == []


def test_llm_generate_text_and_ids_agree_with_transformers(tiny_models):
    """The offline entry point: text prompts are tokenized, outputs decoded; the tokens are
    transformers' greedy ones, as for id prompts."""
    from transformers import AutoTokenizer

    from subway import LLM

    path = tiny_models["llama"]
    llm = LLM(path=path, num_kv_blocks=64, block_size=4)
    tok = AutoTokenizer.from_pretrained(path)
    text = ["Hello there", "The capital of France is"]
    ids = [tok(t)["input_ids"] for t in text]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    by_text = llm.generate(text, sp)
    by_ids = llm.generate(ids, sp)
    for t, i, prompt in zip(by_text, by_ids, ids, strict=True):
        assert t.token_ids == i.token_ids == hf_greedy(path, prompt, 6).tokens
        assert t.text == tok.decode(t.token_ids, skip_special_tokens=True)
        assert i.text is None and t.finish_reason == "length"


@pytest.mark.slow
def test_run_folders_are_private_and_a_named_one_is_never_deleted(tiny_models, tmp_path):
    """The default run folder is made 0700 and removed at the end; a folder the user names
    keeps everything but our sockets; one that others may write to is refused."""
    s = Server(tiny_models["llama"])
    default = f"/tmp/subway-{s.run_id}"
    try:
        assert os.stat(default).st_mode & 0o777 == 0o700
    finally:
        assert s.stop() == 0
    assert not os.path.exists(default)

    named = tmp_path / "run"
    named.mkdir(mode=0o700)
    (named / "mine.txt").write_text("keep")
    s = Server(tiny_models["llama"], "--run-dir", str(named))
    try:
        assert "client.sock" in os.listdir(named)
    finally:
        assert s.stop() == 0
    assert os.listdir(named) == ["mine.txt"] and (named / "mine.txt").read_text() == "keep"

    os.chmod(named, 0o777)
    with pytest.raises(RuntimeError, match="refusing the run folder"):
        Server(tiny_models["llama"], "--run-dir", str(named))
