"""One handoff's KV copy, the two ways a decode worker makes it, side by side in one run:
from a prefill worker's shared memory on this host (`worker/kv_share.py`) and as raw
ZeroMQ frames over loopback CurveZMQ, as from another host (`worker/kv_remote.py`).

    python -m subway.tools.bench.bench_kv_transfer --out docs/bench/kv_transfer.json

The caches have the default model's layout (30 layers, 3 KV heads of 64, `--block-size`
16, `--dtype`); each copy moves `--blocks` blocks (128: a 2,048-token prompt) into
other blocks of a second cache, as a handoff does. Both ends of the tcp copy run in this
process, turn by turn, as the two workers' poll loops would (the server answers, then the
client copies). Reported: the median seconds of `--repeats` copies each way, alternated,
and the bytes moved per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import zmq

from subway.ipc import curve
from subway.ipc.config import IpcConfig
from subway.ipc.kv_leases import LeaseTable
from subway.ipc.messages import KvImport
from subway.ipc.sockets import Sockets
from subway.tools.serve_process import free_port
from subway.worker.kv_cache import allocate_kv_cache
from subway.worker.kv_remote import Fetches, KvServer, block_bytes
from subway.worker.kv_share import Importer, KvLayout, SharedKvCache, layout_of, segment_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run(blocks: int, block_size: int, dtype: str, repeats: int) -> dict:
    layers, heads, dim = 30, 3, 64
    pool = 2 * blocks
    source = f"subway_kvbench{os.getpid()}"
    shared = SharedKvCache(
        segment_name(source, 0), KvLayout(layers, pool, block_size, heads, dim, dtype)
    )
    table = LeaseTable(source, 1, [shared.incarnation])  # one lease, held throughout
    slot, gen = table.grant()
    lease = (slot, gen, table.incarnation)
    for k, v in shared.caches:
        k.copy_(torch.randn(k.shape).to(k.dtype))
        v.copy_(torch.randn(v.shape).to(v.dtype))
    dst = allocate_kv_cache(
        layers, pool, block_size, heads, dim, DTYPES[dtype], torch.device("cpu"), False
    )
    src_ids = list(range(0, pool, 2))[:blocks]
    dst_ids = list(range(1, pool, 2))[:blocks]
    moved = blocks * block_bytes(layout_of(dst)) * 2 * layers
    tmp = tempfile.mkdtemp(prefix="subway-kvbench-")
    key = os.path.join(tmp, "curve.key")
    curve.write_key_file(key)
    ctx = zmq.Context()
    socks = Sockets(ctx, IpcConfig(curve_key_file=key, run_id=source[len("subway_") :]))
    addr = f"tcp://127.0.0.1:{free_port()}"
    server = KvServer(socks, addr, shared.caches)
    poller = zmq.Poller()
    poller.register(server.sock, zmq.POLLIN)
    fetches = Fetches(socks, poller, 0, 1)
    importer = Importer(0)
    times: dict[str, list[float]] = {"shm": [], "tcp": []}
    try:
        for i in range(repeats + 1):  # the first of each: warm-up (mappings, connect)
            t0 = time.perf_counter()
            ok, _, why = importer.run(dst, KvImport(i, source, src_ids, dst_ids, *lease))
            assert ok, why
            t1 = time.perf_counter()
            answer = fetches.start(dst, KvImport(i, addr, src_ids, dst_ids, *lease), t1)
            while answer is None:
                events = dict(poller.poll(10_000))
                if server.sock in events:
                    server.serve()
                done = fetches.on_events(events, dst, time.perf_counter())
                answer = done[0] if done else None
            assert answer.ok, answer.error
            t2 = time.perf_counter()
            if i:
                times["shm"].append(t1 - t0)
                times["tcp"].append(t2 - t1)
        for (dk, dv), (sk, sv) in zip(dst, shared.caches, strict=True):
            assert torch.equal(dk[dst_ids], sk[src_ids]) and torch.equal(dv[dst_ids], sv[src_ids])
    finally:
        fetches.close()
        server.close()
        socks.close()
        ctx.term()
        shared.close()
        table.close()
        os.unlink(key)
        os.rmdir(tmp)
    out = {"blocks": blocks, "block_size": block_size, "dtype": dtype, "bytes": moved}
    for way, ts in times.items():
        med = statistics.median(ts)
        out[way] = {"median_s": med, "all_s": ts, "gb_per_s": moved / med / 1e9}
    out["tcp_over_shm"] = out["tcp"]["median_s"] / out["shm"]["median_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args()
    r = run(a.blocks, a.block_size, a.dtype, a.repeats)
    mb = r["bytes"] / 1e6
    print(f"{a.blocks} blocks of {a.block_size} tokens, {a.dtype}: {mb:.1f} MB a copy")
    for way in ("shm", "tcp"):
        print(f"  {way}: {r[way]['median_s'] * 1e3:8.1f} ms  {r[way]['gb_per_s']:6.2f} GB/s")
    print(f"  tcp / shm: {r['tcp_over_shm']:.2f}x the time")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
