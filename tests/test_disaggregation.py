"""Disaggregated prefill and decode: leases on the prefill side, copies into the decode
side's prefix cache, the shared KV caches, and served engines (greedy equality with
transformers, blocks back to zero on both sides, a lost prefill engine, copies that fail)."""

from __future__ import annotations

import concurrent.futures
import os
import time
import uuid

import httpx
import pytest
import torch
from fake_worker import FakeWorker
from test_scheduler import make_scheduler
from transformers import AutoTokenizer

from subway.ipc.kv_leases import LeaseTable, LeaseView
from subway.ipc.messages import AddRequest, KvImport, KvImported, KvLease, SamplingParams, TokenRef
from subway.scheduler import handoff
from subway.scheduler.engine_core import EngineCore
from subway.scheduler.handoff import Imports, Leases
from subway.tools.proc_title import parse
from subway.worker.kv_cache import allocate_kv_cache
from subway.worker.kv_share import Importer, SharedKvCache, layout_of, segment_name

from reference import hf_greedy
from serving import Server, complete, degraded, free_port, per_engine, until

# The other tiny arch and the default model run in the whole run (`make test-all`).
SLOW_ARCHS = [pytest.param(a, marks=pytest.mark.slow) for a in ("qwen2", "default")]

BS = 4


def request(rid: str, prompt: list[int], max_tokens: int, **kw) -> AddRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return AddRequest(rid, TokenRef(ids=prompt), len(prompt), sp, time.time(), **kw)


def leases(sched, source: str = "subway_x", **kw) -> Leases:
    """A prefill scheduler's leases, over a lease table of a name no other test has."""
    table = LeaseTable(f"subway_t{uuid.uuid4().hex[:12]}", sched.block_manager.num_blocks, [1])
    sched.leases = Leases(sched, source, table=table, **kw)
    return sched.leases


def run(sched, worker, core=None) -> list:
    core = core or EngineCore(sched, worker, 1)
    deltas = []
    for _ in range(500):
        deltas += core.step()
        if not sched.has_work and not sched.has_pending_deltas:
            return deltas
    raise AssertionError("did not finish")


# ------------------------------------------------------------------ the prefill side


def test_a_handoff_request_leases_its_prompt_blocks_until_released():
    sched = make_scheduler(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    table = leases(sched).table
    worker = FakeWorker(16, BS, check_kv=False)
    prompt = list(range(1, 11))  # 2 full blocks and 2 tokens
    sched.add(request("a", prompt, 1, handoff=True), prompt)
    deltas = run(sched, worker)
    lease = deltas[-1].kv_lease
    assert deltas[-1].finish_reason == "length" and len(deltas[-1].token_ids) == 1
    assert isinstance(lease, KvLease) and lease.source == "subway_x" and len(lease.blocks) == 2
    assert lease.incarnation == table.incarnation and lease.generation > 0
    bm = sched.block_manager
    assert bm.num_used_blocks == 3  # the whole table, its partial block too, stays held
    # Other requests fill the pool: no leased block is handed out while the lease holds.
    for i in range(3):
        p = [50 + i] * 16
        sched.add(request(f"b{i}", p, 3), p)
    before = len(worker.plans)
    run(sched, worker)
    given = {b for plan in worker.plans[before:] for s in plan.seqs for b in s.new_blocks}
    assert len(given) == 13  # every other block was used
    assert not given & set(bm.block_table(lease.lease_id))
    view = LeaseView(table.name)
    assert view.check(lease.slot, lease.generation, lease.incarnation) == ""
    assert sched.leases.release(lease.lease_id)
    assert not sched.leases.release(lease.lease_id)  # twice: nothing held
    assert bm.num_used_blocks == 0
    assert "no longer held" in view.check(lease.slot, lease.generation, lease.incarnation)
    table.close()
    # The released prompt is cached: the same prompt is served from it.
    sched.add(request("c", prompt, 2), prompt)
    run(sched, worker)
    assert sched.stats.prefix_hits_total >= 8


def test_an_unreleased_lease_expires_and_a_stop_token_leases_nothing():
    sched = make_scheduler(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    table = leases(sched, lease_s=5.0).table
    worker = FakeWorker(16, BS, check_kv=False)
    prompt = list(range(1, 10))
    sched.add(request("a", prompt, 1, handoff=True), prompt)
    lease = run(sched, worker)[-1].kv_lease
    assert lease is not None
    assert sched.leases.expire(time.monotonic()) == 0
    assert sched.leases.expire(time.monotonic() + 6.0) == 1
    assert sched.block_manager.num_used_blocks == 0
    assert sched.stats.kv_leases_expired_total == 1
    why = LeaseView(table.name).check(lease.slot, lease.generation, lease.incarnation)
    assert "no longer held" in why  # cleared as it expired
    # A prompt shorter than a block: nothing to hand over.
    sched.add(request("s", [1, 2], 1, handoff=True), [1, 2])
    assert run(sched, worker)[-1].kv_lease is None
    assert sched.block_manager.num_used_blocks == 0
    table.close()


# ------------------------------------------------------------------ the decode side


def decode_side(world: int = 1, caching: bool = True):
    sched = make_scheduler(num_blocks=32, block_size=BS, enable_prefix_caching=caching)
    sent: list[KvImport] = []
    return sched, Imports(sched, sent.append, world), sent


def test_a_copied_prompt_is_served_from_the_prefix_cache():
    sched, imports, sent = decode_side(world=2)
    prompt = list(range(1, 12))  # 2 full blocks + 3
    msg = request("a", prompt, 3, kv_source=KvLease(-1, "subway_p", [7, 9]))
    imports.add(msg, prompt)
    assert sched.get("a") is None and len(sent) == 1  # waits for its copy
    (copy,) = sent
    assert copy.src_blocks == [7, 9] and len(copy.dst_blocks) == 2
    imports.on_answer(KvImported(copy.import_id, 0, True, 0.002))
    assert sched.get("a") is None  # one rank of two has answered
    imports.on_answer(KvImported(copy.import_id, 1, True, 0.003))
    assert sched.get("a") is not None and not imports.pending
    assert sched.block_manager.num_used_blocks == 0  # the copy's blocks are cached, not held
    deltas = run(sched, FakeWorker(32, BS, check_kv=False))
    assert sum(len(d.token_ids) for d in deltas) == 3
    assert sched.stats.prefix_hits_total == 8  # the two copied blocks
    assert sched.stats.kv_transfer_blocks_total == 2 and sched.stats.kv_transfer_count == 1
    assert sched.stats.kv_transfer_buckets[1] == 1  # 3 ms: in the 5 ms bucket


def test_a_failed_or_late_copy_recomputes_and_frees_its_blocks(monkeypatch):
    sched, imports, sent = decode_side()
    prompt = list(range(1, 12))
    imports.add(request("a", prompt, 2, kv_source=KvLease(-1, "subway_p", [1, 2])), prompt)
    imports.on_answer(KvImported(sent[0].import_id, 0, False, error="no KV source"))
    assert sched.get("a") is not None and sched.stats.kv_transfer_failures_total == 1
    worker = FakeWorker(32, BS, check_kv=False)
    run(sched, worker)
    assert sched.stats.prefix_hits_total == 0  # computed here, all of it
    # Late: the request goes on at the timeout; the blocks wait for the answer.
    monkeypatch.setattr(handoff, "IMPORT_TIMEOUT_S", 0.0)
    imports.add(request("b", prompt, 2, kv_source=KvLease(-1, "subway_p", [1, 2])), prompt)
    imports.expire(time.monotonic() + 1)
    assert sched.get("b") is not None and sched.stats.kv_transfer_failures_total == 2
    run(sched, worker)
    assert sched.block_manager.num_used_blocks == 2  # the copy may still be writing them
    imports.on_answer(KvImported(sent[1].import_id, 0, True))
    assert sched.block_manager.num_used_blocks == 0 and not imports.pending


def test_an_abort_during_the_copy_ends_the_request_and_frees_everything():
    sched, imports, sent = decode_side()
    prompt = list(range(1, 12))
    imports.add(request("a", prompt, 2, kv_source=KvLease(-1, "subway_p", [1, 2])), prompt)
    assert imports.abort("a")
    assert [d.finish_reason for d in sched.pop_pending_deltas()] == ["abort"]
    imports.on_answer(KvImported(sent[0].import_id, 0, True))
    assert sched.get("a") is None and sched.block_manager.num_used_blocks == 0
    # Without a prefix cache (or room) no copy is tried: the request queues at once.
    sched2, imports2, sent2 = decode_side(caching=False)
    imports2.add(request("z", prompt, 2, kv_source=KvLease(-1, "subway_p", [1, 2])), prompt)
    assert sent2 == [] and sched2.get("z") is not None


# ------------------------------------------------------------------ the copy itself


@pytest.mark.parametrize("dtype,kv_int8", [(torch.float32, False), (torch.bfloat16, False),
                                           (torch.float32, True)])  # fmt: skip
def test_blocks_copy_bit_for_bit_from_a_shared_cache(dtype, kv_int8):
    from subway.worker.kv_cache import kv_slot_layout
    from subway.worker.kv_share import KvLayout

    width, elem = kv_slot_layout(8, dtype, kv_int8)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}[elem]
    source = f"subway_t{os.getpid()}x{int(kv_int8)}"
    shared = SharedKvCache(segment_name(source, 0), KvLayout(2, 6, 4, 2, width, name))
    table = LeaseTable(source, 8, [shared.incarnation])

    def imp(import_id: int, src: list[int], dst: list[int], where: str = source) -> KvImport:
        slot, gen = table.grant()
        return KvImport(import_id, where, src, dst, slot, gen, table.incarnation)

    try:
        for k, v in shared.caches:
            k.copy_(
                torch.randn(k.shape).to(k.dtype)
                if not kv_int8
                else torch.randint(-9, 9, k.shape, dtype=torch.int8)
            )
            v.copy_(
                torch.randn(v.shape).to(v.dtype)
                if not kv_int8
                else torch.randint(-9, 9, v.shape, dtype=torch.int8)
            )
        dst = allocate_kv_cache(2, 10, 4, 2, 8, dtype, torch.device("cpu"), False, kv_int8=kv_int8)
        assert layout_of(dst).same_blocks(layout_of(shared.caches))
        ok, _, why = Importer(0).run(dst, imp(1, [5, 0, 3], [9, 2, 4]))
        assert ok, why
        for (dk, dv), (sk, sv) in zip(dst, shared.caches, strict=True):
            for s, d in ((5, 9), (0, 2), (3, 4)):
                assert torch.equal(dk[d], sk[s]) and torch.equal(dv[d], sv[s])
            assert not dk[[0, 1, 3, 5, 6, 7, 8]].any()  # the other blocks untouched
        for bad, words in (
            (imp(2, [6], [0]), "outside"),
            (imp(3, [1, 2], [0, 0]), "twice"),
            (imp(4, [1], [0, 1]), "destinations"),
            (imp(5, [1], [0], "../etc/passwd"), "not a KV source"),
            (imp(6, [1], [0], "subway_nobody"), "no KV source"),
            (KvImport(8, source, [1], [0]), "no lease named"),
        ):
            ok, _, why = Importer(0).run(dst, bad)
            assert not ok and words in why, why
        other = allocate_kv_cache(
            2, 10, 4, 1, 8, dtype, torch.device("cpu"), False, kv_int8=kv_int8
        )
        ok, _, why = Importer(0).run(other, imp(7, [1], [0]))
        assert not ok and "another layout" in why
    finally:
        shared.close()
        table.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(source)]


# ------------------------------------------------------------------ served


PD = ["--prefill-engines", "1", "--decode-engines", "1", "--threads", "1",
      "--max-num-batched-tokens", "24", "--block-size", "8", "--num-kv-blocks", "256"]  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", *SLOW_ARCHS])
def test_prefill_then_decode_equals_transformers(tiny_models, default_model, arch):
    """Many requests in flight, prompts chunked on the prefill engine (a 24-token budget),
    a second wave served from the prefill engine's prefix cache; the prompts' blocks
    copied to the decode engine; every block back when all is done."""
    path = default_model if arch == "default" else tiny_models[arch]
    s = Server(path, *PD, whole=True)
    try:
        roles = sorted(
            (k["kind"], k.get("role")) for k in map(parse, (c.cmdline() for c in s.children()))
        )
        assert roles == [("frontend", None), ("scheduler", "decode"), ("scheduler", "prefill"),
                         ("worker", "decode"), ("worker", "prefill")]  # fmt: skip
        prompts = [[(7 * i + 11 * j) % 900 + 20 for i in range(43)] for j in range(6)]
        n = 8 if arch == "default" else 12
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            first = list(pool.map(lambda p: complete(s.url, p, n), prompts))
            second = list(pool.map(lambda p: complete(s.url, p, n), prompts))
        tok = AutoTokenizer.from_pretrained(path)
        for p, a, b in zip(prompts, first, second, strict=True):
            want = tok.decode(hf_greedy(path, p, n).tokens)
            assert a == want and b == want
        # Each request handed off had its 5 full blocks copied. A request is routed once when
        # one engine serves it whole (an engine silent for a heartbeat's 3 s, on a loaded
        # machine, gets none: the other serves whole), twice when it is handed off.
        routed = per_engine(s.url, "subway:routed_requests_total")
        handed = routed["0"] + routed.get("1", 0) - 2 * len(prompts)
        assert handed > 0
        copied = per_engine(s.url, "subway:kv_transfer_blocks_total")["1"]
        failed = per_engine(s.url, "subway:kv_transfer_failures_total")["1"]
        assert (copied, failed) == (5 * handed, 0), (handed, s.read_output()[-3000:])
        assert sum(per_engine(s.url, "subway:prefix_cache_hits_total").values()) > 0

        def all_back() -> bool:
            used = per_engine(s.url, "subway:kv_cache_usage_perc")
            leases = per_engine(s.url, "subway:kv_leases")
            return used == {"0": 0.0, "1": 0.0} and leases == {"0": 0.0, "1": 0.0}

        until(all_back, 10)  # the last releases may trail the last tokens by a turn
    finally:
        assert s.stop() == 0
        assert s.shm_files() == []


def test_blocks_cross_as_zeromq_frames_as_between_hosts(tiny_models):
    """`--kv-addr`: the prefill engine serves its leased blocks over CurveZMQ tcp (as to a
    decode engine on another host), the decode engine fetches them: the same tokens."""
    path = tiny_models["qwen2"]
    s = Server(path, *PD, "--kv-addr", f"tcp://127.0.0.1:{free_port()}", whole=True)
    try:
        prompts = [[(5 * i + 13 * j) % 800 + 40 for i in range(43)] for j in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(s.url, p, 10), prompts))
        tok = AutoTokenizer.from_pretrained(path)
        assert got == [tok.decode(hf_greedy(path, p, 10).tokens) for p in prompts]
        routed = per_engine(s.url, "subway:routed_requests_total")  # twice if handed off
        handed = routed.get("0", 0) + routed.get("1", 0) - len(prompts)
        assert handed > 0
        assert per_engine(s.url, "subway:kv_transfer_failures_total")["1"] == 0
        assert per_engine(s.url, "subway:kv_transfer_blocks_total")["1"] == 5 * handed
        until(lambda: per_engine(s.url, "subway:kv_leases")["0"] == 0, 10)
    finally:
        assert s.stop() == 0


@pytest.mark.slow
def test_without_a_prefix_cache_the_decode_engine_recomputes(tiny_models):
    path = tiny_models["llama"]
    s = Server(path, *PD, "--no-prefix-caching", whole=True)
    try:
        prompt = [(5 * i) % 700 + 30 for i in range(40)]
        want = AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, prompt, 10).tokens)
        assert complete(s.url, prompt, 10) == want
        assert per_engine(s.url, "subway:kv_transfer_failures_total")["1"] == 1
        assert per_engine(s.url, "subway:kv_transfer_blocks_total")["1"] == 0
        until(lambda: per_engine(s.url, "subway:kv_leases")["0"] == 0, 10)
    finally:
        assert s.stop() == 0


def test_with_the_prefill_engine_lost_the_decode_engine_serves_alone(tiny_models):
    path = tiny_models["llama"]
    s = Server(path, *PD, whole=True)
    try:
        victim = next(c for c in s.children()
                      if parse(c.cmdline()).get("role") == "prefill"
                      and parse(c.cmdline())["kind"] == "worker")  # fmt: skip
        victim.kill()

        until(lambda: degraded(s.url), 20)
        prompt = [(3 * i) % 500 + 40 for i in range(30)]
        want = AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, prompt, 6).tokens)
        assert complete(s.url, prompt, 6) == want
    finally:
        assert s.stop() == 0
        assert s.shm_files() == []


def _stream_many(url: str, n: int, tokens: int) -> list:
    """`n` streaming requests at once, each to the end; each result is its text, or the
    exception or error finish it ended with."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]

    def one(i: int):
        try:
            stream = client.completions.create(
                model=model, prompt=[(13 * i + 7 * j) % 800 + 25 for j in range(40)],
                max_tokens=tokens, stream=True, temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            text, reason = "", None
            for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text if reason == "length" else RuntimeError(reason)
        except Exception as e:  # noqa: BLE001 - the outcome under test
            return e

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_an_engine_killed_under_load_leaks_no_block_and_nothing_hangs(tiny_models, victim):
    """kill -9 of one side's worker while requests pass through both: every request ends
    (done, or with an error) within its timeout, and the surviving engine's blocks and
    leases all come back."""
    s = Server(tiny_models["llama"], *PD, whole=True)
    try:
        worker = next(c for c in s.children()
                      if parse(c.cmdline()).get("role") == victim
                      and parse(c.cmdline())["kind"] == "worker")  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(_stream_many, s.url, 8, 400)
            until(lambda: per_engine(s.url, "subway:kv_transfer_blocks_total")["1"] > 0, 30)
            worker.kill()  # streams are on the decode engine, others maybe still prefilling
            outcomes = load.result(timeout=120)  # nothing hangs
        assert len(outcomes) == 8
        if victim == "decode":  # its streams were cut: they end with an error
            assert any(not isinstance(o, str) for o in outcomes), outcomes
        survivor = "1" if victim == "prefill" else "0"

        def all_back() -> bool:
            used = per_engine(s.url, "subway:kv_cache_usage_perc")[survivor]
            if victim == "prefill":  # a dead engine's figures are its last report
                return used == 0.0
            return used == 0.0 and per_engine(s.url, "subway:kv_leases")["0"] == 0.0

        until(all_back, 40)  # within the lease's 30 s at most
        assert httpx.get(s.url + "/health", timeout=2).status_code == 200  # degraded, serving
        done = complete(s.url, [(3 * i) % 500 + 40 for i in range(30)], 4)  # still serves
        assert isinstance(done, str)
    finally:
        s.stop()
    assert s.shm_files() == []
