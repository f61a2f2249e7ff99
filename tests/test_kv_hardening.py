"""Disaggregation's KV transfer under delay, restart and a full /dev/shm (issue #43).

A copy is used only if its lease still held after it (a generation in the prefill
engine's lease table, `ipc/kv_leases.py`); a prefill engine restarted under the same
run id is told apart by incarnation; a KV port that does not read fails its imports,
not the decode worker; fetches in flight to one peer are bounded; a lease is freed when
every rank acknowledged its copy in the table; KV segments reserve their pages when made.

The races are made here the way they happen, but on cue: the lease ends (its slot is
cleared, as `Leases.release` and `expire` do before freeing) and the source blocks are
rewritten with another prompt's KV between the copy's first and last layer.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import pytest
import torch
from fake_worker import FakeWorker
from test_disaggregation import BS, decode_side, request, run
from test_kv_remote import Plane, caches
from test_scheduler import make_scheduler
from transformers import AutoTokenizer

from subway.ipc import shm
from subway.ipc.kv_leases import LeaseTable, segment_name
from subway.ipc.messages import KvImport, KvImported, KvLayout, KvLease
from subway.scheduler import handoff
from subway.worker import kv_remote, kv_share
from subway.worker.kv_cache import allocate_kv_cache
from subway.worker.kv_remote import FRAME_SLACK, MAX_FETCHES_PER_PEER, block_bytes
from subway.worker.kv_share import Importer, SharedKvCache, layout_of

from reference import hf_greedy
from serving import Server, complete, free_port, per_engine, until

CPU = torch.device("cpu")
LAYOUT = KvLayout(2, 8, BS, 2, 8, "float32")  # the decode side's caches: 2 layers, 2 x 8 heads


def prefill_segment(source: str, seed: int = 0) -> SharedKvCache:
    """A prefill worker's shared caches of `source`, filled with one prompt's 'KV'."""
    shared = SharedKvCache(segment_name(source, 0), LAYOUT)
    g = torch.Generator().manual_seed(seed)
    for k, v in shared.caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return shared


def decode_caches(blocks: int = 32):
    return allocate_kv_cache(2, blocks, BS, 2, 8, torch.float32, CPU, False)


def new_source() -> str:
    return f"subway_h{uuid.uuid4().hex[:12]}"


def lease_of(table: LeaseTable, source: str, blocks: list[int]) -> KvLease:
    slot, gen = table.grant()
    return KvLease(-1, source, blocks, slot, gen, table.incarnation)


# ------------------------------------------------------------------ a lease's end mid-copy


def test_a_copy_whose_lease_ends_midway_fails_and_its_blocks_are_never_cached(monkeypatch):
    """The prefill engine's lease expires during the copy and its blocks are rewritten with
    another prompt's KV: the import fails, the decode engine computes the prompt itself,
    and the copied (torn) blocks are never keyed into its prefix cache. The same copy left
    alone is made, and served from."""
    source = new_source()
    shared = prefill_segment(source)
    table = LeaseTable(source, 8, [shared.incarnation])
    real = kv_share.copy_layer
    try:
        for interfere in (False, True):
            layers: list[int] = []
            lease = lease_of(table, source, [5, 2])

            def midway(d, s, s_idx, d_idx, lease=lease, layers=layers, now=interfere) -> None:
                real(d, s, s_idx, d_idx)
                layers.append(1)
                if now and len(layers) == 1:  # after the first layer: expired, reused
                    table.revoke(lease.slot)
                    for k, v in shared.caches:
                        k[[5, 2]] = 7.0
                        v[[5, 2]] = 7.0

            monkeypatch.setattr(kv_share, "copy_layer", midway)
            hits, why = _import_and_serve(lease)
            assert len(layers) == 2
            if interfere:
                assert "no longer held after the copy" in why
                assert hits == 0  # computed, all of it
            else:
                assert why == "" and hits == 8  # the 2 copied blocks
    finally:
        table.close()
        shared.close()


def _import_and_serve(lease: KvLease) -> tuple[int, str]:
    """A decode engine's scheduler and rank 0 take a request under `lease` and serve it:
    (its prefix cache hits, why the copy failed or "")."""
    sched, imports, sent = decode_side()
    dst = decode_caches()
    prompt = list(range(1, 12))  # 2 full blocks + 3
    imports.add(request("a", prompt, 2, kv_source=lease), prompt)
    (msg,) = sent
    assert (msg.slot, msg.generation, msg.incarnation) == (
        lease.slot, lease.generation, lease.incarnation,
    )  # fmt: skip
    ok, seconds, why = Importer(0).run(dst, msg)
    imports.on_answer(KvImported(msg.import_id, 0, ok, seconds, why))
    run(sched, FakeWorker(32, BS, check_kv=False))
    assert sched.block_manager.num_used_blocks == 0
    return sched.stats.prefix_hits_total, why


def test_a_lease_ended_before_the_copy_writes_nothing():
    source = new_source()
    shared = prefill_segment(source)
    table = LeaseTable(source, 8, [shared.incarnation])
    try:
        dst = decode_caches()
        lease = lease_of(table, source, [1, 3])
        table.revoke(lease.slot)
        again = lease_of(table, source, [1, 3])  # the slot's next lease: another generation
        assert again.slot == lease.slot and again.generation != lease.generation
        msg = KvImport(1, source, [1, 3], [4, 6], lease.slot, lease.generation, lease.incarnation)
        ok, _, why = Importer(0).run(dst, msg)
        assert not ok and "no longer held" in why and "after" not in why
        assert not any(k.any() or v.any() for k, v in dst)
    finally:
        table.close()
        shared.close()


# ------------------------------------------------------------------ a restart, same run id


def test_a_prefill_engine_restarted_under_the_same_run_id_is_noticed():
    """Its segments come back under the same names with other contents: the importer
    copies the new engine's blocks, not the dead one's that it still has mapped, and
    refuses the dead engine's leases."""
    source = new_source()
    importer = Importer(0)
    dst = decode_caches()
    old = prefill_segment(source, seed=1)
    old_table = LeaseTable(source, 8, [old.incarnation])
    old_lease = lease_of(old_table, source, [2])
    msg = KvImport(1, source, [2], [3], old_lease.slot, old_lease.generation, old_table.incarnation)
    assert importer.run(dst, msg)[0]  # maps the first engine's segment and table
    old_keys = old.caches[0][0][2].clone()
    old.close()  # the engine stops: its names go, the importer's mappings stay
    old_table.close()
    new = prefill_segment(source, seed=2)
    table = LeaseTable(source, 8, [new.incarnation])
    try:
        lease = lease_of(table, source, [2])
        assert lease.slot == old_lease.slot and lease.generation == old_lease.generation
        msg = KvImport(2, source, [2], [4], lease.slot, lease.generation, lease.incarnation)
        ok, _, why = importer.run(dst, msg)
        assert ok, why
        assert torch.equal(dst[0][0][4], new.caches[0][0][2])
        assert not torch.equal(dst[0][0][4], old_keys)
        # The dead engine's lease names the same slot and generation: refused all the same.
        stale = KvImport(3, source, [2], [5], old_lease.slot, old_lease.generation,
                         old_lease.incarnation)  # fmt: skip
        ok, _, why = importer.run(dst, stale)
        assert not ok and "another incarnation" in why
        assert not dst[0][0][5].any()
    finally:
        table.close()
        new.close()
    # A table that records another worker than the segment's (a worker restarted alone).
    seg = prefill_segment(source, seed=3)
    odd = LeaseTable(source, 8, [seg.incarnation + 2])
    try:
        lease = lease_of(odd, source, [1])
        msg = KvImport(4, source, [1], [6], lease.slot, lease.generation, lease.incarnation)
        ok, _, why = importer.run(dst, msg)
        assert not ok and "not of the engine that leased" in why
    finally:
        odd.close()
        seg.close()


# ------------------------------------------------------------------ between hosts


def test_the_kv_server_sends_blocks_only_while_their_lease_holds(tmp_path, monkeypatch):
    """tcp: the server checks the lease before reading the blocks and after; a lease that
    ended (before, or while it read) and a restarted engine's old lease are refused."""
    src, dst = caches(6), caches(10)
    before = [(k.clone(), v.clone()) for k, v in dst]
    plane = Plane(tmp_path, src)
    try:
        ended = plane.imp(1, [1], [0])
        plane.table.revoke(ended.slot)
        answer, _ = plane.run(dst, ended)
        assert not answer.ok and "no longer held" in answer.error

        during = plane.imp(2, [2, 3], [4, 5])
        reads = []

        def read(t, real=kv_remote._raw):
            reads.append(1)
            if len(reads) == 1:  # the lease expires while the server reads its blocks
                plane.table.revoke(during.slot)
            return real(t)

        monkeypatch.setattr(kv_remote, "_raw", read)
        answer, _ = plane.run(dst, during)
        assert not answer.ok and "no longer held" in answer.error, answer.error
        assert len(reads) == 4  # every frame was read; none was sent
        monkeypatch.undo()
        for (dk, dv), (bk, bv) in zip(dst, before, strict=True):
            assert torch.equal(dk, bk) and torch.equal(dv, bv)

        old = plane.imp(3, [1], [0])
        plane.table.close()  # the prefill engine restarts under the same run id
        plane.table = LeaseTable(plane.ipc.kv_source, 64, [1])
        answer, _ = plane.run(dst, old)
        assert not answer.ok and "another incarnation" in answer.error
        answer, _ = plane.run(dst, plane.imp(4, [1], [0]))
        assert answer.ok, answer.error
        assert plane.server.served == 1 and plane.server.refused == 3
    finally:
        plane.close()


def test_an_unreachable_kv_port_fails_its_imports_not_the_decode_worker(tmp_path):
    """Nobody reads the port: at most MAX_FETCHES_PER_PEER fetches are in flight to it
    (the next fails at once), and once its socket's queue is full of asks that timed out,
    the send's zmq.Again fails that import instead of raising out of the worker."""
    plane = Plane(tmp_path, None)  # no server: the address is not listened on
    dst = caches(4)
    try:
        answers = [plane.fetches.start(dst, plane.imp(i, [0], [1]), 0.0) for i in range(40)]
        assert answers[:MAX_FETCHES_PER_PEER] == [None] * MAX_FETCHES_PER_PEER
        for a in answers[MAX_FETCHES_PER_PEER:]:
            assert not a.ok and f"{MAX_FETCHES_PER_PEER} fetches in flight" in a.error
        late = plane.fetches.on_events({}, dst, now=100.0)  # each times out, and fails
        assert len(late) == MAX_FETCHES_PER_PEER and not any(a.ok for a in late)
        again = plane.fetches.start(dst, plane.imp(99, [0], [1]), 100.0)  # its queue is full
        assert not again.ok and "takes no more asks" in again.error
    finally:
        plane.close()


# ------------------------------------------------------------------ the release


def test_a_lease_is_freed_as_soon_as_every_rank_acknowledged_its_copy():
    """The importer acknowledges the lease in the prefill engine's table when its copy is
    over; the prefill scheduler frees the lease on its next turn, long before its time or
    the frontend's ReleaseKv (which then changes nothing, quietly)."""
    source = new_source()
    shared = SharedKvCache(segment_name(source, 0), KvLayout(2, 16, BS, 2, 8, "float32"))
    table = LeaseTable(source, 16, [shared.incarnation])
    try:
        sched = make_scheduler(num_blocks=16, block_size=BS, enable_prefix_caching=True)
        leases = sched.leases = handoff.Leases(sched, source, table=table)
        prompt = list(range(1, 11))  # 2 full blocks and 2 tokens
        worker = FakeWorker(16, BS, check_kv=False)
        sched.add(request("a", prompt, 1, handoff=True), prompt)
        lease = run(sched, worker)[-1].kv_lease
        assert leases.expire(time.monotonic()) == 0 and lease.lease_id in leases.held
        assert not table.acked(lease.slot, lease.generation)
        msg = KvImport(1, source, list(lease.blocks), [3, 4], lease.slot, lease.generation,
                       lease.incarnation)  # fmt: skip
        ok, _, why = Importer(0).run(decode_caches(), msg)
        assert ok, why
        assert table.acked(lease.slot, lease.generation)
        assert leases.expire(time.monotonic()) == 0  # none past its time: freed by its ack
        assert leases.held == {} and sched.stats.kv_leases == 0
        assert sched.block_manager.num_used_blocks == 0
        assert leases.release(lease.lease_id)  # the frontend's ReleaseKv: no news
        assert sched.stats.kv_leases_expired_total == 0
        # A copy that fails acknowledges too (the decode engine recomputes): freed as well.
        sched.add(request("b", prompt, 1, handoff=True), prompt)
        lease = run(sched, worker)[-1].kv_lease
        bad = KvImport(2, source, list(lease.blocks), [99, 98], lease.slot, lease.generation,
                       lease.incarnation)  # fmt: skip
        ok, _, why = Importer(0).run(decode_caches(), bad)
        assert not ok and "outside" in why
        leases.expire(time.monotonic())
        assert leases.held == {}
    finally:
        table.close()
        shared.close()


def test_the_kv_server_acknowledges_a_lease_after_its_last_ask(tmp_path):
    """tcp: a fetch in three asks; the lease is acknowledged for the asker's rank only once
    the last ask is answered."""
    src, dst = caches(12), caches(12, fill=False)
    plane = Plane(tmp_path, src, max_message_bytes=3 * block_bytes(layout_of(src)) + FRAME_SLACK)
    try:
        msg = plane.imp(1, [11, 3, 7, 0, 5, 9, 1], list(range(7)))
        assert plane.fetches.start(dst, msg, 0.0) is None
        served = []
        while True:
            events = dict(plane.poller.poll(5000))
            assert events, "nothing moved within 5 s"
            if plane.server.sock in events:
                plane.server.serve()
                served.append(plane.table.acked(msg.slot, msg.generation))
            done = plane.fetches.on_events(events, dst, 0.0)
            if done:
                break
        assert done[0].ok, done[0].error
        assert served == [False, False, True]
    finally:
        plane.close()


# ------------------------------------------------------------------ /dev/shm reserved


def test_a_segment_that_dev_shm_cannot_hold_fails_when_made(monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    source = new_source()
    words = r"cannot reserve \d+ bytes of shared memory for the KV caches .*: No space left"
    with pytest.raises(shm.ShmSpaceError, match=words):
        SharedKvCache(segment_name(source, 0), LAYOUT)
    with pytest.raises(shm.ShmSpaceError, match="for a lease table"):
        LeaseTable(source, 8, [1])
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(source)]


_SMALL_SHM = """
import sys
from subway.ipc.messages import KvLayout
from subway.worker.kv_share import SharedKvCache
try:
    SharedKvCache("subway_small_kv0", KvLayout(4, 256, 16, 8, 64, "float32"))  # 64 MiB
except Exception as e:
    print(type(e).__name__, e)
    sys.exit(3)
print("made")
"""


def small_shm(size: str) -> list[str]:
    """A command prefix that runs what follows with a private /dev/shm of `size` (a tmpfs
    in a user and mount namespace of its own); skips where those namespaces are refused."""
    unshare = shutil.which("unshare")
    probe = [unshare, "-rm", "true"] if unshare else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespaces here (unshare -rm) to mount a small tmpfs")
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return [unshare, "-rm", "sh", "-c", script, "sh"]


def test_a_dev_shm_too_small_is_a_clear_error_not_a_sigbus():
    """A real tmpfs of 8 MiB as /dev/shm: the KV segment of 64 MiB fails when made, with
    the sizes; where its pages were only sized, the first write of a page that did not
    fit killed the process with SIGBUS."""
    done = subprocess.run(
        [*small_shm("8m"), sys.executable, "-c", _SMALL_SHM], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    want = "ShmSpaceError [Errno 28] cannot reserve 67112960 bytes of shared memory for the KV"
    assert want in done.stdout, done.stdout
    assert "(8388608 bytes free there): No space left on device" in done.stdout


# ------------------------------------------------------------------ served


PD = ["--prefill-engines", "1", "--decode-engines", "1", "--threads", "1",
      "--block-size", "8", "--num-kv-blocks", "256", "--max-num-seqs", "1"]  # fmt: skip


def test_a_lease_is_released_when_its_copy_is_made_not_when_the_request_runs(tiny_models):
    """One place in the decode engine's batch (--max-num-seqs 1), a long request in it: a
    second request is handed off and its blocks copied, then waits for that place. Its
    lease is given back when the copy is made, while the first request still runs; it
    used to be held until the second request's first decode token, after the first had
    finished (or for the lease's 30 s)."""
    s = Server(tiny_models["llama"], *PD, whole=True)
    try:
        import openai

        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = httpx.get(s.url + "/v1/models", timeout=5).json()["data"][0]["id"]

        def stream(prompt: list[int], n: int) -> float:
            """Streams a completion to its end; the time it ended."""
            chunks = client.completions.create(
                model=model, prompt=prompt, max_tokens=n, stream=True, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in chunks:
                pass
            return time.monotonic()

        def copied() -> float:
            return per_engine(s.url, "subway:kv_transfer_blocks_total").get("1", 0.0)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # 1000 tokens: long enough that the lease's release is seen (a /metrics
            # scrape on a loaded machine) before it ends; 300 once ended 0.14 s before.
            long = pool.submit(stream, [(7 * i) % 800 + 20 for i in range(40)], 1000)
            until(lambda: copied() >= 5, 60)  # the long one is on the decode engine
            short = pool.submit(stream, [(11 * i) % 800 + 30 for i in range(40)], 4)
            until(lambda: copied() >= 10, 60)  # the short one's blocks are copied
            released = until(lambda: per_engine(s.url, "subway:kv_leases")["0"] == 0, 60)
            released_at = time.monotonic()
            long_done, short_done = long.result(timeout=120), short.result(timeout=120)
        assert released_at < long_done, (released, "released only after the long one ended")
        assert short_done >= long_done  # it did wait for the place
        assert per_engine(s.url, "subway:kv_leases_expired_total")["0"] == 0
        assert per_engine(s.url, "subway:kv_transfer_failures_total")["1"] == 0
    finally:
        assert s.stop() == 0
    assert s.shm_files() == []


def test_a_prefill_engine_without_room_in_dev_shm_says_so(tiny_models):
    """`subway serve` with a 64 MiB /dev/shm (the token buffers fit, the prefill engine's
    1 GiB of KV caches do not): that engine stops at start with the reason in `/health`
    and the log, the decode engine serves whole requests. Its worker used to die of
    SIGBUS (exit -7) while zeroing its caches, the engine "not ready" without a word."""
    port = free_port()
    cmd = [sys.executable, "-m", "subway.tools.cli", "serve", "--model", tiny_models["llama"],
           "--port", str(port), "--run-id", "t" + uuid.uuid4().hex[:8], "--threads", "1",
           "--dist-init-addr", f"127.0.0.1:{free_port()}", "--prefill-engines", "1",
           "--decode-engines", "1", "--block-size", "8"]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix="subway-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([*small_shm("64m"), *cmd], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def engines() -> list[dict]:
        assert proc.poll() is None, open(log.name).read()
        try:
            body = httpx.get(url + "/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return []
        return body.get("engines", [])

    def settled() -> bool:
        states = [e["state"] for e in engines()]
        return len(states) == 2 and states[1] == "serving" and states[0] != "not ready"

    try:
        until(settled, 240)  # startup: a loaded machine can take minutes
        prefill = engines()[0]["state"]
        assert "cannot reserve 1073745920 bytes" in prefill, prefill
        text = open(log.name).read()
        assert "exited with code -7" not in text
        assert "--kv-cache-memory, --num-kv-blocks" in text  # the whole message, in the log
        ok = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3},
                        timeout=60)  # fmt: skip
        assert ok.status_code == 200  # the decode engine serves it whole
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


@pytest.mark.slow
def test_a_prefill_engine_restarted_under_the_same_run_id_hands_off_its_own_kv(tiny_models):
    """Engines started one by one; the prefill engine stopped and started again under the
    same run id, the decode engine and the frontend running on. The decode engine copies
    the new engine's blocks, not the dead one's it still had mapped: the same tokens as
    transformers. (It used to copy the dead engine's blocks of the same ids, another
    prompt's KV, and answer with other tokens, counting no failure.)"""
    path = tiny_models["llama"]
    port = free_port()
    common = ["--model", path, "--run-id", "t" + uuid.uuid4().hex[:8], "--prefill-engines", "1",
              "--decode-engines", "1", "--threads", "1", "--block-size", "8",
              "--num-kv-blocks", "256", "--max-num-batched-tokens", "24", "--port", str(port),
              "--dist-init-addr", f"127.0.0.1:{free_port()}"]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix="subway-pd-", suffix=".log", delete=False)

    def start(kind: str, *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "subway.tools.cli", kind, *common, *extra]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    url = f"http://127.0.0.1:{port}"

    def all_serving() -> bool:
        assert all(p.poll() is None for p in procs.values()), open(log.name).read()[-3000:]
        try:
            r = httpx.get(url + "/health", timeout=1)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json()["status"] == "ok"

    def transfers() -> tuple[float, float]:
        return (per_engine(url, "subway:kv_transfer_blocks_total")["1"],
                per_engine(url, "subway:kv_transfer_failures_total")["1"])  # fmt: skip

    procs = {"decode": start("scheduler", "--engine-id", "1"),
             "decode worker": start("worker", "--engine-id", "1"),
             "prefill": start("scheduler", "--engine-id", "0"),
             "prefill worker": start("worker", "--engine-id", "0"),
             "frontend": start("frontend")}  # fmt: skip
    tok = AutoTokenizer.from_pretrained(path)
    first = [(7 * i) % 900 + 20 for i in range(43)]  # 5 full blocks of 8
    second = [(11 * i) % 900 + 25 for i in range(43)]
    try:
        until(all_serving, 180)
        assert complete(url, first, 8) == tok.decode(hf_greedy(path, first, 8).tokens)
        assert transfers() == (5, 0)
        for name in ("prefill", "prefill worker"):
            procs[name].terminate()
        assert [procs[n].wait(60) for n in ("prefill", "prefill worker")] == [0, 0]
        procs["prefill"] = start("scheduler", "--engine-id", "0")
        procs["prefill worker"] = start("worker", "--engine-id", "0")
        until(all_serving, 180)
        assert complete(url, second, 8) == tok.decode(hf_greedy(path, second, 8).tokens)
        assert transfers() == (10, 0)  # handed off, and copied
    finally:
        for p in procs.values():
            p.terminate()
        codes = [p.wait(60) for p in procs.values()]
    assert codes == [0] * 5
