"""Data-parallel engines behind one frontend: the config each engine derives, the prefix
router, the digests the block manager reports, and served engines (greedy equality with
transformers, prefix-aware routing, one engine lost, processes started by hand)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from subway.frontend.router import Load, PrefixRouter
from subway.ipc.config import EngineConfig
from subway.ipc.prefix import prompt_digests
from subway.scheduler.block_manager import BlockManager
from subway.tools.proc_title import parse, title

from reference import hf_greedy
from serving import Server, complete, degraded, free_port, per_engine, until

# The other tiny arch and the default model run in the whole run (`make test-all`).
SLOW_ARCHS = [pytest.param(a, marks=pytest.mark.slow) for a in ("qwen2", "default")]

# ------------------------------------------------------------------ config


def test_engine_zero_is_the_config_itself_and_others_get_their_own_names():
    c = EngineConfig.build(data_parallel_size=3, run_id="r1")
    assert c.engine(0) == c
    e2 = c.engine(2)
    assert e2.parallel.data_parallel_rank == 2
    assert e2.ipc.run_id == "r1-2" and e2.ipc.run_dir == c.ipc.run_dir
    addrs = [getattr(e.ipc, f"{n}_addr") for e in (c, c.engine(1), e2)
             for n in ("scheduler", "frontend", "plan", "result")]  # fmt: skip
    assert len(set(addrs)) == len(addrs)  # no two engines meet at one socket
    assert e2.ipc.sampled_shm_name != c.ipc.sampled_shm_name
    assert e2.ipc.prompt_shm_name != c.engine(1).ipc.prompt_shm_name


def test_tcp_addresses_shift_by_the_engine_and_a_list_names_schedulers():
    c = EngineConfig.build(
        data_parallel_size=2, scheduler_addr="tcp://10.0.0.1:7000",
        frontend_addr="tcp://10.0.0.9:7100", dist_init_addr="10.0.0.1:29600",
    )  # fmt: skip
    e1 = c.engine(1)
    assert e1.ipc.scheduler_addr == "tcp://10.0.0.1:7001"
    assert e1.ipc.frontend_addr == "tcp://10.0.0.9:7101"
    assert e1.parallel.dist_init_addr == "10.0.0.1:29601"
    listed = c.replace(engine_addrs="tcp://a:1, tcp://b:2")
    assert [listed.engine(i).ipc.scheduler_addr for i in (0, 1)] == ["tcp://a:1", "tcp://b:2"]
    assert listed.engine(1).ipc.frontend_addr == "tcp://10.0.0.9:7101"
    with pytest.raises(ValueError, match="names 1 engines"):
        c.replace(engine_addrs="tcp://a:1").engine(0)
    with pytest.raises(ValueError, match="out of range"):
        c.engine(2)


def test_a_process_started_by_hand_outside_the_engines_is_a_message():
    from subway.tools.cli import one_engine

    with pytest.raises(SystemExit, match="data-parallel-size"):
        one_engine(EngineConfig.build(data_parallel_rank=1))


def test_process_titles_name_kind_engine_role_and_rank():
    c = EngineConfig.build(data_parallel_size=2).engine(1)
    t = title("worker", c, 0)
    assert t == "subway worker engine=1 role=both rank=0"
    assert parse([t]) == {"kind": "worker", "engine": "1", "role": "both", "rank": "0"}
    assert parse(["python", "-m", "subway.tools.cli", "scheduler", "--config-json", "-"]) == {
        "kind": "scheduler"
    }
    assert parse(["bash"]) == {}


# ------------------------------------------------------------------ digests and the router


def test_the_block_manager_reports_the_digests_the_frontend_computes():
    bm = BlockManager(8, 4, enable_caching=True, track_digests=True)
    prompt = list(range(100, 111))  # 2 full blocks and 3 tokens
    bm.allocate(1, len(prompt))
    bm.cache_blocks(1, prompt, [], len(prompt))
    stored, removed = bm.take_digest_events()
    assert sorted(stored) == sorted(prompt_digests(prompt, 4)) and removed == []
    assert bm.take_digest_events() == ([], [])
    # A second sequence with the same prefix reuses the cached blocks: nothing new.
    hits = bm.lookup(prompt, [], 2)
    bm.allocate_with_prefix(2, hits, 4)
    bm.cache_blocks(2, prompt[:8] + [7, 7, 7, 7], [], 12)
    stored, _ = bm.take_digest_events()
    assert stored == prompt_digests(prompt[:8] + [7, 7, 7, 7], 4)[2:]
    bm.free(1)
    bm.free(2)
    bm.allocate(3, 8 * 4)  # takes every block: the cached ones are evicted
    stored, removed = bm.take_digest_events()
    assert stored == [] and len(removed) == 3
    assert bm.cached_digests() == []


def test_the_router_prefers_the_prefix_then_the_least_loaded():
    r = PrefixRouter(2, block_size=4, overload=2)
    idle = [Load(0, 0, 0.0), Load(0, 0, 0.0)]
    prompt = list(range(40))
    # Nothing cached: the least loaded, ties taken in turn.
    assert {r.choose(prompt, idle).engine for _ in range(2)} == {0, 1}
    assert r.choose(prompt, [Load(3, 0, 0.1), Load(1, 0, 0.5)]).engine == 1
    assert r.choose(prompt, [Load(3, 1, 0.1), Load(3, 0, 0.5)]).engine == 1  # then waiting
    assert r.choose(prompt, [Load(3, 0, 0.1), Load(3, 0, 0.5)]).engine == 0  # then KV
    # Engine 1 holds the first 5 blocks, engine 0 the first 2.
    digests = prompt_digests(prompt, 4)
    r.update(1, digests[:5], [], reset=False)
    r.update(0, digests[:2], [], reset=False)
    route = r.choose(prompt, [Load(0, 0, 0.0), Load(2, 1, 0.9)])
    assert (route.engine, route.reason, route.cached_blocks) == (1, "prefix", 5)
    # Overloaded: more than 2 more in flight than the least loaded.
    route = r.choose(prompt, [Load(0, 0, 0.0), Load(3, 0, 0.9)])
    assert (route.engine, route.reason) == (0, "overloaded")
    # An engine that cannot serve is never chosen; one that lost its cache holds nothing.
    assert r.choose(prompt, [Load(0, 0, 0.0), None]).engine == 0
    r.update(1, [], digests[:5], reset=False)
    assert r.choose(prompt, [Load(2, 0, 0.0), Load(0, 0, 0.0)]).reason == "prefix"  # engine 0
    r.update(0, [], [], reset=True)
    assert r.choose(prompt, [Load(2, 0, 0.0), Load(0, 0, 0.0)]).reason == "least_loaded"
    with pytest.raises(LookupError):
        r.choose(prompt, [None, None])


# ------------------------------------------------------------------ served


@pytest.mark.parametrize("arch", ["llama", *SLOW_ARCHS])
def test_two_engines_equal_transformers(tiny_models, default_model, arch):
    """Many requests in flight over both engines, prompts chunked (a 24-token budget), and
    served again from the prefix cache in a second wave."""
    path = default_model if arch == "default" else tiny_models[arch]
    flags = ["-dp", "2", "--threads", "1", "--max-num-batched-tokens", "24",
             "--block-size", "8", "--num-kv-blocks", "256"]  # fmt: skip
    s = Server(path, *flags, whole=True)
    try:
        kids = [parse(c.cmdline()) for c in s.children()]
        assert sorted((k["kind"], k.get("engine")) for k in kids) == [
            ("frontend", None), ("scheduler", "0"), ("scheduler", "1"),
            ("worker", "0"), ("worker", "1"),
        ]  # fmt: skip
        # Distinct prompts spread over both engines; asked again, each is served from the
        # cache of the engine that computed it.
        prompts = [[(7 * i + 11 * j) % 900 + 20 for i in range(43)] for j in range(8)]
        n = 8 if arch == "default" else 12
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            first = list(pool.map(lambda p: complete(s.url, p, n), prompts))
            second = list(pool.map(lambda p: complete(s.url, p, n), prompts))
        tok = AutoTokenizer.from_pretrained(path)
        for p, a, b in zip(prompts, first, second, strict=True):
            want = tok.decode(hf_greedy(path, p, n).tokens)
            assert a == want and b == want
        routed = per_engine(s.url, "subway:routed_requests_total")
        assert routed.get("0", 0) > 0 and routed.get("1", 0) > 0, routed
        assert sum(per_engine(s.url, "subway:prefix_cache_hits_total").values()) > 0
    finally:
        assert s.stop() == 0
        assert s.shm_files() == []


def test_requests_sharing_a_prefix_land_on_the_engine_holding_it(tiny_models):
    s = Server(tiny_models["llama"], "-dp", "2", "--threads", "1", "--block-size", "8",
               "--num-kv-blocks", "256", whole=True)  # fmt: skip
    try:
        for seed, count in ((1, 5), (2, 5)):  # two documents, each asked about 5 times
            doc = [(seed * 31 + 13 * i) % 900 + 20 for i in range(64)]
            complete(s.url, doc + [5], 2)  # computes and caches the document somewhere
            before = per_engine(s.url, "subway:prefix_cache_hits_total")
            for q in range(count):
                complete(s.url, doc + [6 + q], 2)
            after = per_engine(s.url, "subway:prefix_cache_hits_total")
            gained = {e: after[e] - before.get(e, 0) for e in after}
            holder = max(gained, key=gained.get)
            # Every question was served from the holder's cache: 64 tokens each (8 blocks).
            assert gained[holder] == count * 64, gained
            assert sum(gained.values()) == count * 64
        routed = per_engine(s.url, "subway:routed_requests_total")
        assert sum(routed.values()) == 12
    finally:
        assert s.stop() == 0


def test_one_engine_lost_under_load_the_other_serves_on(tiny_models):
    """kill -9 of engine 1's worker while 8 streams run over both engines: engine 1's
    end with an error, engine 0's finish, `/health` stays 200 (degraded)."""
    from test_disaggregation import _stream_many

    # whole: a load that starts while one engine is still coming up all goes to the other
    # (seen once in a full run: every stream on engine 1, all failed).
    s = Server(tiny_models["llama"], "-dp", "2", "--threads", "1", "--num-kv-blocks", "256",
               whole=True)  # fmt: skip
    try:
        victim = next(
            c for c in s.children() if parse(c.cmdline()) == {
                "kind": "worker", "engine": "1", "role": "both", "rank": "0"}
        )  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(_stream_many, s.url, 8, 300)
            until(lambda: per_engine(s.url, "subway:num_requests_running").get("1", 0) > 0, 60)
            victim.kill()
            outcomes = load.result(timeout=120)
        failed = [o for o in outcomes if not isinstance(o, str)]
        assert 0 < len(failed) < 8, outcomes  # engine 1's failed, engine 0's finished

        until(lambda: degraded(s.url), 20)
        states = httpx.get(s.url + "/health", timeout=2).json()["engines"]
        assert states[0]["state"] == "serving" and "died" in states[1]["state"]
        for i in range(4):  # every request goes to the engine that serves
            complete(s.url, [10 + i, 11, 12], 3)
        assert s.proc.poll() is None  # serve goes on with one engine
        until(lambda: len(s.children()) == 3, 20)  # engine 1's scheduler was stopped
    finally:
        assert s.stop() == 0
        assert s.shm_files() == []


def _free_pair() -> int:
    """A port p with p + 1 free too (engine 1's derived port)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no two adjacent free ports")


def test_engines_started_by_hand_over_tcp(tiny_models, tmp_path):
    """As engines on other hosts would be: each engine's scheduler and worker are their
    own commands, with their rank; the frontend finds the schedulers by `--engine-addrs`."""
    cli = [sys.executable, "-m", "subway.tools.cli"]
    key_file = str(tmp_path / "engine.key")
    subprocess.run([*cli, "keygen", key_file], check=True, timeout=60)
    base = {n: _free_pair() for n in ("scheduler", "frontend", "plan", "result")}
    other = _free_pair()  # engine 1's scheduler, named apart as on another host
    http = _free_pair()
    common = ["--curve-key-file", key_file, "--model", tiny_models["llama"], "--no-shm",
              "--run-id", f"dp{http}", "-dp", "2", "--threads", "1", "--num-kv-blocks", "64",
              "--port", str(http), "--dist-init-addr", f"127.0.0.1:{_free_pair()}"]  # fmt: skip
    addrs = [f"--{n}-addr=tcp://127.0.0.1:{p}" for n, p in base.items()]
    engine1 = [a for a in addrs if not a.startswith("--scheduler")]
    engine1.append(f"--scheduler-addr=tcp://127.0.0.1:{other}")
    listed = f"tcp://127.0.0.1:{base['scheduler']},tcp://127.0.0.1:{other + 1}"
    procs = [
        subprocess.Popen([*cli, "scheduler", *common, *addrs, "--engine-id", "0"]),
        subprocess.Popen([*cli, "worker", *common, *addrs, "--engine-id", "0"]),
        subprocess.Popen([*cli, "scheduler", *common, *engine1, "--data-parallel-rank", "1"]),
        subprocess.Popen([*cli, "worker", *common, *engine1, "--data-parallel-rank", "1"]),
        subprocess.Popen([*cli, "frontend", *common, *addrs, "--engine-addrs", listed]),
    ]
    url = f"http://127.0.0.1:{http}"
    try:

        def both_serving() -> bool:
            assert all(p.poll() is None for p in procs)
            try:
                r = httpx.get(url + "/health", timeout=1)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and r.json()["status"] == "ok"

        until(both_serving, 180)
        for i in range(4):
            complete(url, [30 + i, 31, 32, 33], 4)
        routed = per_engine(url, "subway:routed_requests_total")
        assert routed.get("0", 0) > 0 and routed.get("1", 0) > 0, routed
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in procs]
    assert codes == [0] * 5
    assert not [f for f in os.listdir("/dev/shm") if f"dp{http}" in f]
