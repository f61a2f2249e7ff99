"""KV blocks between hosts: a prefill worker's `KvServer` and a decode worker's `Fetches`,
on loopback tcp with CurveZMQ, as the two workers run them (worker/kv_remote.py), with
the prefill engine's lease table that the server checks (ipc/kv_leases.py)."""

from __future__ import annotations

import msgspec
import pytest
import torch
import zmq

from subway.ipc import curve
from subway.ipc.config import IpcConfig
from subway.ipc.kv_leases import LeaseTable
from subway.ipc.messages import KvBlocks, KvFetch, KvImport
from subway.ipc.sockets import Sockets
from subway.worker.kv_cache import allocate_kv_cache
from subway.worker.kv_remote import FRAME_SLACK, Fetches, KvServer, block_bytes
from subway.worker.kv_share import layout_of

from serving import free_port

CPU = torch.device("cpu")


def caches(blocks: int, heads: int = 2, dtype=torch.float32, kv_int8=False, fill=True):
    out = allocate_kv_cache(2, blocks, 4, heads, 8, dtype, CPU, False, kv_int8=kv_int8)
    if fill:
        for k, v in out:
            for t in (k, v):
                t.copy_(torch.randint(-9, 9, t.shape).to(t.dtype))
    return out


class Plane:
    """Both ends on loopback: a server over `src`, fetches into `dst`, one poller, and the
    lease table of the server's engine (`lease` grants one)."""

    def __init__(self, tmp_path, src, max_message_bytes=64 << 20, timeout=8.0, world=1):
        key = str(tmp_path / "curve.key")
        curve.write_key_file(key)
        self.ipc = IpcConfig(curve_key_file=key, max_message_bytes=max_message_bytes)
        self.table = LeaseTable(self.ipc.kv_source, 64, [1] * world)
        self.ctx = zmq.Context()
        self.socks = Sockets(self.ctx, self.ipc)
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.server = KvServer(self.socks, self.addr, src) if src is not None else None
        self.poller = zmq.Poller()
        if self.server is not None:
            self.poller.register(self.server.sock, zmq.POLLIN)
        self.fetches = Fetches(self.socks, self.poller, 0, world, timeout)

    def imp(self, import_id: int, src: list[int], dst: list[int], source: str = "") -> KvImport:
        """An import of `src` into `dst` under a new lease."""
        slot, gen = self.table.grant()
        return KvImport(import_id, source or self.addr, src, dst, slot, gen, self.table.incarnation)

    def run(self, dst, msg: KvImport, now: float = 0.0):
        """Start `msg` and turn the loop until its answer; (answer, turns)."""
        answer = self.fetches.start(dst, msg, now)
        turns = 0
        while answer is None:
            turns += 1
            assert turns < 1000, "no answer"
            events = dict(self.poller.poll(5000))
            assert events, "nothing moved within 5 s"
            if self.server is not None and self.server.sock in events:
                self.server.serve()
            done = self.fetches.on_events(events, dst, now)
            answer = done[0] if done else None
        return answer, turns

    def close(self):
        self.fetches.close()
        if self.server is not None:
            self.server.close()
        self.socks.close()
        self.ctx.term()
        self.table.close()


@pytest.mark.parametrize("dtype,kv_int8", [(torch.float32, False), (torch.bfloat16, False),
                                           (torch.float32, True)])  # fmt: skip
def test_blocks_cross_as_frames_bit_for_bit(tmp_path, dtype, kv_int8):
    src, dst = caches(6, dtype=dtype, kv_int8=kv_int8), caches(10, dtype=dtype, kv_int8=kv_int8)
    before = [(k.clone(), v.clone()) for k, v in dst]
    plane = Plane(tmp_path, src)
    try:
        answer, _ = plane.run(dst, plane.imp(7, [5, 0, 3], [9, 2, 4]))
        assert answer.ok and answer.import_id == 7, answer.error
        for (dk, dv), (sk, sv), (bk, bv) in zip(dst, src, before, strict=True):
            for s, d in ((5, 9), (0, 2), (3, 4)):
                assert torch.equal(dk[d], sk[s]) and torch.equal(dv[d], sv[s])
            rest = [0, 1, 3, 5, 6, 7, 8]
            assert torch.equal(dk[rest], bk[rest]) and torch.equal(dv[rest], bv[rest])
        assert plane.server.served == 1 and plane.fetches.refused == 0
    finally:
        plane.close()


def test_a_fetch_larger_than_a_message_goes_in_several_asks(tmp_path):
    src, dst = caches(12), caches(12, fill=False)
    one = block_bytes(layout_of(src))
    plane = Plane(tmp_path, src, max_message_bytes=3 * one + FRAME_SLACK)  # 3 blocks a frame
    try:
        ids = [11, 3, 7, 0, 5, 9, 1]
        answer, turns = plane.run(dst, plane.imp(1, ids, list(range(7))))
        assert answer.ok, answer.error
        assert plane.server.served == 3 and turns >= 3  # 3 + 3 + 1 blocks
        for (dk, dv), (sk, sv) in zip(dst, src, strict=True):
            assert torch.equal(dk[:7], sk[ids]) and torch.equal(dv[:7], sv[ids])
    finally:
        plane.close()


def test_refusals_write_nothing(tmp_path):
    src, dst = caches(6), caches(10)
    before = [(k.clone(), v.clone()) for k, v in dst]
    plane = Plane(tmp_path, src)
    try:
        for msg, words in (
            (plane.imp(1, [6], [0]), "outside [0, 6)"),  # the server's check
            (plane.imp(2, [1], [10]), "outside [0, 10)"),  # ours, before asking
            (plane.imp(3, [1, 2], [0, 0]), "destinations"),
            (plane.imp(4, [1], [0], "tcp://evil host:1"), "not a KV source"),
            (plane.imp(5, [1], [0], f"{plane.addr},{plane.addr}"), "2 ranks for 1"),
            (KvImport(8, plane.addr, [1], [0]), "no lease named"),  # ours, before asking
        ):
            answer, _ = plane.run(dst, msg)
            assert not answer.ok and words in answer.error, answer.error
        keyless = Fetches(Sockets(plane.ctx, IpcConfig()), zmq.Poller(), 0, 1)
        answer = keyless.start(dst, plane.imp(7, [1], [0]), 0.0)
        assert not answer.ok and "--curve-key-file" in answer.error  # refused, not raised
        other = caches(10, heads=1)  # another layout: refused when the header comes
        answer, _ = plane.run(other, plane.imp(6, [1], [0]))
        assert not answer.ok and "another layout" in answer.error
        for (dk, dv), (bk, bv) in zip(dst, before, strict=True):
            assert torch.equal(dk, bk) and torch.equal(dv, bv)
    finally:
        plane.close()


def test_a_silent_source_times_out_and_its_late_answer_is_dropped(tmp_path):
    """A fake server that holds its answer: the fetch fails at the timeout (the clock is
    passed in), and the answer that comes afterwards is refused, writing nothing."""
    dst = caches(4)
    before = [(k.clone(), v.clone()) for k, v in dst]
    plane = Plane(tmp_path, None, timeout=8.0)
    fake = plane.socks.bind(zmq.ROUTER, plane.addr)
    try:
        assert plane.fetches.start(dst, plane.imp(1, [0], [1]), now=0.0) is None
        ident, raw = fake.recv_multipart()  # the ask arrived; no answer yet
        ask = msgspec.msgpack.decode(raw, type=KvFetch)
        assert ask.blocks == [0]
        assert plane.fetches.on_events({}, dst, now=7.9) == []
        [late] = plane.fetches.on_events({}, dst, now=8.1)
        assert not late.ok and "no answer within 8 s" in late.error
        frames = [bytes(block_bytes(layout_of(dst)))] * 4
        head = msgspec.msgpack.encode(KvBlocks(ask.fetch_id, layout_of(dst)))
        fake.send_multipart([ident, head, *frames])
        sock = plane.fetches.sockets[0]
        assert sock.poll(5000)
        assert plane.fetches.on_events({sock: zmq.POLLIN}, dst, now=9.0) == []
        assert plane.fetches.refused == 1
        for (dk, dv), (bk, bv) in zip(dst, before, strict=True):
            assert torch.equal(dk, bk) and torch.equal(dv, bv)
    finally:
        fake.close(linger=0)
        plane.close()


def test_malformed_answers_and_asks_are_counted_not_fatal(tmp_path):
    dst = caches(4)
    plane = Plane(tmp_path, None)
    fake = plane.socks.bind(zmq.ROUTER, plane.addr)
    try:
        assert plane.fetches.start(dst, plane.imp(1, [0, 1], [2, 3]), now=0.0) is None
        ident, raw = fake.recv_multipart()
        ask = msgspec.msgpack.decode(raw, type=KvFetch)
        sock = plane.fetches.sockets[0]
        fake.send_multipart([ident, b"\xc1 not msgpack"])
        assert sock.poll(5000)
        assert plane.fetches.on_events({sock: zmq.POLLIN}, dst, now=0.1) == []
        short = [bytes(block_bytes(layout_of(dst)))] * 4  # one block a frame, two asked
        fake.send_multipart(
            [ident, msgspec.msgpack.encode(KvBlocks(ask.fetch_id, layout_of(dst))), *short]
        )
        assert sock.poll(5000)
        [answer] = plane.fetches.on_events({sock: zmq.POLLIN}, dst, now=0.2)
        assert not answer.ok and "not of" in answer.error
        assert plane.fetches.refused == 2
    finally:
        fake.close(linger=0)
        plane.close()
    # The server side: garbage and bad asks are counted, good ones still served.
    src = caches(4)
    (tmp_path / "b").mkdir()
    plane = Plane(tmp_path / "b", src)
    client = plane.socks.connect(zmq.DEALER, plane.addr)
    try:
        client.send(b"garbage")
        client.send_multipart([b"two", b"frames"])
        slot, gen = plane.table.grant()
        inc = plane.table.incarnation
        client.send(msgspec.msgpack.encode(KvFetch(3, [], slot, gen, inc)))
        client.send(msgspec.msgpack.encode(KvFetch(4, [1], slot, gen, inc)))
        got = []
        while len(got) < 2:
            assert plane.server.sock.poll(5000)
            plane.server.serve()
            while client.poll(100):
                got.append(client.recv_multipart())
        heads = [msgspec.msgpack.decode(g[0], type=KvBlocks) for g in got]
        assert [h.fetch_id for h in heads] == [3, 4]
        assert "0 blocks asked" in heads[0].error and len(got[0]) == 1
        assert heads[1].error == "" and len(got[1]) == 1 + 4
        assert plane.server.refused == 3 and plane.server.served == 1
    finally:
        client.close(linger=0)
        plane.close()


def test_kv_addr_names_each_rank_and_engine_apart_and_a_bad_one_is_refused():
    from subway.ipc.config import EngineConfig

    c = EngineConfig.build(kv_addr="tcp://127.0.0.1:7000", prefill_engines=2,
                           decode_engines=1, tensor_parallel_size=2)  # fmt: skip
    # Rank r of engine i: PORT + i + r x 3 engines; no two ranks of the three meet.
    assert c.engine(0).kv_source == "tcp://127.0.0.1:7000,tcp://127.0.0.1:7003"
    assert c.engine(1).kv_source == "tcp://127.0.0.1:7001,tcp://127.0.0.1:7004"
    one_host = EngineConfig.build()
    assert one_host.kv_source == one_host.ipc.kv_source  # its shm prefix
    from subway.ipc import curve

    assert curve.needs_curve(c.ipc)  # the KV plane is tcp: a key file is needed
    for bad in ("ipc:///tmp/x", "tcp://host", "tcp://a b:1", "tcp://h:1;rm"):
        with pytest.raises(ValueError, match="--kv-addr"):
            EngineConfig.build(kv_addr=bad)
