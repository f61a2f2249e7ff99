"""Moving whole KV blocks between two caches: bit-exact, and every malformed input refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from subway.worker.kv_cache import allocate_kv_cache, block_bytes
from subway.worker.kv_transfer import (
    KvBlocksHeader,
    KvLayout,
    KvStaging,
    KvTransferError,
    decode_frames,
    encode_frames,
    header_for,
    layout_of,
    pack_blocks,
    staging_name,
    unpack_blocks,
)

LAYERS, BLOCK, HEADS, HEAD_DIM = 3, 4, 2, 8
KINDS = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False),
         "int8": (torch.bfloat16, True)}  # fmt: skip
CPU = torch.device("cpu")


def cache(kind: str, num_blocks: int, seed: int, device: torch.device = CPU, heads: int = HEADS):
    """A cache of random bytes (NaN patterns included: the copy must not care what they mean)."""
    dtype, kv_int8 = KINDS[kind]
    caches = allocate_kv_cache(LAYERS, num_blocks, BLOCK, heads, HEAD_DIM, dtype, device,
                               huge_pages=False, kv_int8=kv_int8)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for pair in caches:
        for t in pair:
            raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen)
            t.view(torch.uint8).view(-1).copy_(raw.to(torch.uint8))
    return caches


def block(caches, layer: int, kv: int, b: int) -> bytes:
    return caches[layer][kv][b].cpu().view(torch.uint8).numpy().tobytes()


def snapshot(caches) -> list[bytes]:
    return [t.cpu().view(torch.uint8).numpy().tobytes() for pair in caches for t in pair]


@pytest.fixture
def shm_clean():
    """Names that a test creates; none may be left in /dev/shm afterwards."""
    before = set(os.listdir("/dev/shm"))
    yield f"kvtest{os.getpid()}"
    left = [n for n in set(os.listdir("/dev/shm")) - before if "kvtest" in n]
    assert not left, f"leaked shared memory: {left}"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip_bit_exact(kind):
    src, dst = cache(kind, 10, seed=1), cache(kind, 7, seed=2)
    layout = layout_of(src)
    dtype, kv_int8 = KINDS[kind]
    assert layout == layout_of(dst)  # pools of different sizes share a layout
    assert layout.block_bytes == block_bytes(LAYERS, BLOCK, HEADS, HEAD_DIM, dtype, kv_int8)
    assert layout.dtype == ("int8" if kv_int8 else kind)
    assert layout.width == HEAD_DIM + (4 if kv_int8 else 0)
    src_ids, dst_ids = [7, 2, 9, 4], [5, 0, 3, 6]
    before = snapshot(dst)
    data = pack_blocks(src, src_ids)
    # The defined order: block-major, then layer, then k before v.
    order = [block(src, layer, kv, b) for b in src_ids for layer in range(LAYERS) for kv in (0, 1)]
    assert bytes(data) == b"".join(order)
    out = bytearray(len(data))
    assert bytes(pack_blocks(src, src_ids, out=memoryview(out))) == bytes(data) == bytes(out)

    unpack_blocks(dst, dst_ids, bytes(data), layout)  # read-only bytes, as a socket hands them
    for s, d in zip(src_ids, dst_ids, strict=True):
        for layer in range(LAYERS):
            for kv in (0, 1):
                assert block(dst, layer, kv, d) == block(src, layer, kv, s)
    for layer in range(LAYERS):
        for kv in (0, 1):
            for b in set(range(7)) - set(dst_ids):
                got, was = block(dst, layer, kv, b), before[2 * layer + kv]
                assert got == was[b * len(got) : (b + 1) * len(got)]


def test_empty_transfer():
    src = cache("float32", 4, seed=1)
    assert len(pack_blocks(src, [])) == 0
    unpack_blocks(src, [], b"", layout_of(src))


@pytest.mark.parametrize(
    "other",
    [dict(kind="bfloat16"), dict(kind="int8"), dict(kind="float32", heads=1)],
)
def test_layout_mismatch_refused(other):
    src, dst = cache("float32", 4, seed=1), cache(num_blocks=4, seed=2, **other)
    before = snapshot(dst)
    data = pack_blocks(src, [0, 1])
    with pytest.raises(KvTransferError, match="layout"):
        unpack_blocks(dst, [0, 1], data, layout_of(src))
    assert snapshot(dst) == before


@pytest.mark.parametrize("ids", [[1, 1], [0, 4], [-1, 0], [0, 2.0], ["0", 1]])
def test_bad_block_ids_refused(ids):
    src, dst = cache("bfloat16", 4, seed=1), cache("bfloat16", 4, seed=2)
    layout = layout_of(src)
    data = pack_blocks(src, [0, 1])
    before = snapshot(dst)
    with pytest.raises(KvTransferError):
        unpack_blocks(dst, ids, data, layout)
    with pytest.raises(KvTransferError):
        pack_blocks(src, ids)
    assert snapshot(dst) == before


@pytest.mark.parametrize("delta", [-1, 1, -4096])
def test_wrong_length_refused(delta):
    src, dst = cache("int8", 4, seed=1), cache("int8", 4, seed=2)
    layout = layout_of(src)
    data = bytes(pack_blocks(src, [2, 3]))
    bad = data[:delta] if delta < 0 else data + b"\0" * delta
    before = snapshot(dst)
    with pytest.raises(KvTransferError, match="bytes"):
        unpack_blocks(dst, [0, 1], bad, layout)
    with pytest.raises(KvTransferError):
        pack_blocks(src, [2, 3], out=memoryview(bytearray(len(bad))))
    with pytest.raises(KvTransferError, match="writable"):
        pack_blocks(src, [2, 3], out=memoryview(data))
    assert snapshot(dst) == before


def test_frames_round_trip_over_zmq():
    zmq = pytest.importorskip("zmq")
    src, dst = cache("bfloat16", 6, seed=3), cache("bfloat16", 6, seed=4)
    layout = layout_of(src)
    payload = pack_blocks(src, [5, 1])
    header = header_for("req-1", layout, payload)
    assert header.num_blocks == 2
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://kv")
        b.connect("inproc://kv")
        a.send_multipart(encode_frames(header, payload), copy=False)
        got, data = decode_frames(b.recv_multipart(copy=False))
    finally:
        a.close(linger=0), b.close(linger=0), ctx.term()
    assert got == header
    unpack_blocks(dst, [0, 3], data, got.layout)
    assert block(dst, 2, 1, 3) == block(src, 2, 1, 1)


def test_bad_frames_refused():
    src = cache("float32", 4, seed=5)
    layout = layout_of(src)
    payload = bytes(pack_blocks(src, [0, 3]))
    header = header_for("r", layout, payload)
    head, body = encode_frames(header, payload)
    flipped = bytearray(body)
    flipped[len(flipped) // 2] ^= 1
    wrong = msgspec.structs.replace(layout, block_bytes=layout.block_bytes // 2)
    lying = msgspec.msgpack.encode(msgspec.structs.replace(header, layout=wrong, num_blocks=4))
    cases = [
        ("frames", [head]),
        ("3 frames", [head, body, b""]),
        ("bad KV blocks header", [b"\x93garbage", body]),
        ("bad KV blocks header", [msgspec.msgpack.encode(["other", 1]), body]),  # wrong tag
        ("says", [head, body[:-1]]),
        ("checksum", [head, bytes(flipped)]),
        ("shape", [lying, body]),  # block_bytes that disagree with the layout's shape
    ]
    for match, frames in cases:
        with pytest.raises(KvTransferError, match=match):
            decode_frames(frames)
    with pytest.raises(KvTransferError):
        encode_frames(header, payload[:-1])
    with pytest.raises(KvTransferError, match="whole blocks"):
        header_for("r", layout, payload[:-1])
    assert decode_frames([head, body])[0] == header


def test_staging_offsets_checked(shm_clean):
    src = cache("int8", 4, seed=6)
    layout = layout_of(src)
    one = bytes(pack_blocks(src, [1]))
    with KvStaging.create(staging_name(shm_clean), layout, capacity=3) as stage:
        stage.write(2, one)
        assert stage.read(2, 1) == one
        for offset, n in [(-1, 1), (3, 1), (2, 2), (0, 4), (0, -1), (10**12, 1)]:
            with pytest.raises(KvTransferError, match="outside"):
                stage.read(offset, n)
            if n > 0:
                with pytest.raises(KvTransferError, match="outside"):
                    stage.write(offset, one * n)
        with pytest.raises(KvTransferError, match="whole blocks"):
            stage.write(0, one[:-1])
        with pytest.raises(KvTransferError, match="exists"):
            KvStaging.create(stage.name, layout, 1)
        other = layout_of(cache("float32", 2, seed=0))
        with pytest.raises(KvTransferError, match="layout"):
            KvStaging.open(stage.name, other)
    with pytest.raises(KvTransferError, match="closed"):
        stage.read(0, 1)
    stage.close()  # idempotent
    with pytest.raises(KvTransferError, match="no shared-memory"):
        KvStaging.open(stage.name, layout)
    with pytest.raises(KvTransferError):
        KvStaging.create(staging_name(shm_clean), layout, 0)


CHILD = textwrap.dedent("""
    import sys, msgspec, torch
    from subway.worker.kv_cache import allocate_kv_cache
    from subway.worker.kv_transfer import KvLayout, KvStaging, layout_of, pack_blocks, unpack_blocks

    name, raw = sys.argv[1], sys.argv[2]
    layout = msgspec.json.decode(raw, type=KvLayout)
    caches = allocate_kv_cache({layers}, 5, {block}, {heads}, {head_dim}, torch.bfloat16,
                               torch.device("cpu"), huge_pages=False, kv_int8=True)
    assert layout_of(caches) == layout
    with KvStaging.open(name, layout) as stage:
        view = stage.view(0, 3)
        unpack_blocks(caches, [4, 0, 2], view, layout)  # zero-copy, from the slots in place
        del view
        out = stage.view(3, 3)
        pack_blocks(caches, [2, 4, 0], out=out)  # back into slots 3..5, in another order
        del out
    print("ok")
""").format(layers=LAYERS, block=BLOCK, heads=HEADS, head_dim=HEAD_DIM)


def test_staging_across_processes(shm_clean):
    src = cache("int8", 8, seed=7)
    layout = layout_of(src)
    sent = bytes(pack_blocks(src, [6, 1, 3]))
    with KvStaging.create(staging_name(shm_clean), layout, capacity=6) as stage:
        stage.write(0, sent)
        child = subprocess.run(
            [sys.executable, "-c", CHILD, stage.name, msgspec.json.encode(layout).decode()],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert child.returncode == 0, child.stderr
        assert child.stdout.strip() == "ok"
        assert "leaked" not in child.stderr  # the attach was not left to its resource tracker
        # The child attached and exited: the segment is still the owner's.
        assert os.path.exists(f"/dev/shm/{stage.name}")
        # Child's block 2 <- src 3, block 4 <- src 6, block 0 <- src 1.
        assert stage.read(3, 3) == bytes(pack_blocks(src, [3, 6, 1]))
        assert stage.read(0, 3) == sent
    assert not os.path.exists(f"/dev/shm/{stage.name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_to_cpu_round_trip():
    src, dst = cache("bfloat16", 6, seed=8, device=torch.device("cuda")), cache("bfloat16", 6, 9)
    data = pack_blocks(src, [5, 0])
    unpack_blocks(dst, [1, 2], data, layout_of(src))
    assert block(dst, 1, 0, 1) == block(src, 1, 0, 5)
    back = cache("bfloat16", 6, seed=10, device=torch.device("cuda"))
    unpack_blocks(back, [3, 4], pack_blocks(dst, [1, 2]), layout_of(dst))
    assert block(back, 2, 1, 4) == block(src, 2, 1, 0)


def test_layout_wire_form():
    layout = layout_of(cache("float32", 2, seed=0))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=KvLayout) == layout
    with pytest.raises(KvTransferError, match="dtype"):
        msgspec.structs.replace(layout, dtype="nope").check()
    assert isinstance(header_for("x", layout, b""), KvBlocksHeader)


def test_odd_caches_and_buffers_refused(shm_clean):
    from multiprocessing import shared_memory

    good = cache("float32", 4, seed=1)
    layout = layout_of(good)
    wide = torch.zeros(4, BLOCK, HEADS, 2 * HEAD_DIM)
    strided = [good[0], (wide[..., ::2], good[1][1])]  # layer 1's k: same shape, strided
    mixed = [good[0], cache("float32", 5, seed=2)[1]]
    for caches in ([], strided, mixed):
        with pytest.raises(KvTransferError):
            layout_of(caches)
    for data in (None, 12, memoryview(bytearray(2 * layout.block_bytes))[::2]):
        with pytest.raises(KvTransferError):
            unpack_blocks(good, [0], data, layout)
    raw = shared_memory.SharedMemory(name=staging_name(shm_clean), create=True, size=4096)
    try:
        with pytest.raises(KvTransferError, match="not a KV staging"):
            KvStaging.open(raw.name, layout)
    finally:
        raw.close()
        raw.unlink()
