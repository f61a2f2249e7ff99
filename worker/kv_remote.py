"""KV blocks between hosts (disaggregated prefill and decode): raw ZeroMQ frames over the
authenticated tcp plane.

A prefill engine started with `--kv-addr tcp://HOST:PORT` names its ranks' addresses in
its leases (`EngineConfig.kv_source`); each of its workers binds a ROUTER there
(`KvServer`, a CurveZMQ server like every tcp:// socket: only holders of the engine key
file connect). A decode worker told to import from such a source (`KvImport`) asks the
prefill worker of its own rank for the blocks (`KvFetch`) and gets a `KvBlocks` header
and then one raw frame per layer and cache, keys then values, each holding the blocks in
the order asked (`Fetches`). On a GPU the frames are staged through host memory.

Each ask names its lease (`KvFetch`: slot, generation, incarnation), and the server
answers only while the lease holds, checked in its engine's lease table
(`ipc/kv_leases.py`, on the server's host) before it reads the blocks and again after:
blocks given back and rewritten are never sent as the lease's. The table is looked up
again at each ask, so a server of a restarted engine refuses the old engine's leases.
Having answered a lease's last ask, the server acknowledges the lease for the asker's
rank in that table: its blocks are read, and the engine may free them.

Both ends run in their worker's poll loop, between steps, on one thread: the server
answers when its step is done; the client sends its asks without waiting and copies
each answer into its blocks when it comes, which no plan touches until the scheduler
has every rank's `KvImported`. Every answer is checked before a byte is written (its
id, the layout, the frame count and each frame's size); a refused or late one fails
the import, and the decode engine computes the prompt itself. A fetch unanswered for
`FETCH_TIMEOUT_S` fails, and whatever comes for it afterwards is dropped: nothing is
written after its `KvImported` went out. Fetches larger than one message may be
(`ipc.max_message_bytes`) go in several asks, one after the other.

A peer that does not read (down, stopped, unreachable) costs only its imports: at most
`MAX_FETCHES_PER_PEER` fetches are in flight to one address (past it an import fails
at once), its socket queues no more asks than that (SNDHWM), and a send that would
block (`zmq.Again`) fails the import it was for. Each failed import recomputes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import msgspec
import torch
import zmq

from subway.ipc.config import KV_ADDR_RE
from subway.ipc.kv_leases import KvShareError, LeaseView, LeaseViews
from subway.ipc.messages import KvBlocks, KvFetch, KvImport, KvImported, KvLayout
from subway.ipc.sockets import Sockets, has_message
from subway.worker.kv_share import KV_DTYPES, layout_of
from subway.worker.model import KVCache

# Well inside the scheduler's IMPORT_TIMEOUT_S (10 s), after which the request goes on
# without the copy: every rank's answer (made or failed) comes before the scheduler lets
# go of the destination blocks.
FETCH_TIMEOUT_S = 8.0
MAX_SOURCE_RANKS = 64
MAX_FETCHES_PER_PEER = 32  # in flight to one prefill worker; past it an import fails at once
FRAME_SLACK = 4096  # room in a message for CurveZMQ's framing (ZMQ_MAXMSGSIZE counts it)


def blocks_per_ask(max_message_bytes: int, layout: KvLayout) -> int:
    """The most blocks one answer's frames may hold within `max_message_bytes`."""
    return max(1, (max_message_bytes - FRAME_SLACK) // block_bytes(layout))


def is_remote(source: str) -> bool:
    return source.startswith("tcp://")


def block_bytes(layout: KvLayout) -> int:
    itemsize = torch.empty(0, dtype=KV_DTYPES[layout.dtype]).element_size()
    return layout.block_size * layout.num_kv_heads * layout.width * itemsize


class KvServer:
    """A prefill worker's blocks, served to decode workers of its rank on other hosts."""

    def __init__(self, socks: Sockets, addr: str, caches: list[KVCache]) -> None:
        self.sock = socks.bind(zmq.ROUTER, addr)
        self.caches = caches
        self.layout = layout_of(caches)
        self.max_blocks = blocks_per_ask(socks.ipc.max_message_bytes, self.layout)
        self.served = 0
        self.refused = 0  # malformed asks, counted and answered (when they name an id)
        self.prefix = socks.ipc.kv_source  # this engine's shm prefix: its lease table's name
        self._tables = LeaseViews()
        self._table: LeaseView | None = None  # the one the last ask was checked in
        self._decode = msgspec.msgpack.Decoder(KvFetch)
        self._encode = msgspec.msgpack.Encoder()

    def serve(self) -> None:
        """Answer every ask waiting now."""
        while has_message(self.sock):
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            if len(frames) != 2:
                self.refused += 1
                continue
            ident, raw = frames
            try:
                ask = self._decode.decode(raw)
            except msgspec.DecodeError:
                self.refused += 1
                continue
            error = self._check(ask) or self._lease(ask)
            if not error:
                idx = torch.tensor(ask.blocks, dtype=torch.long, device=self.caches[0][0].device)
                frames = [_raw(c.index_select(0, idx)) for kv in self.caches for c in kv]
                error = self._lease(ask)  # again, after the read: see the module docstring
            if error:
                self.refused += 1
                self.sock.send_multipart(
                    [ident, self._encode.encode(KvBlocks(ask.fetch_id, error=error))]
                )
                continue
            head = self._encode.encode(KvBlocks(ask.fetch_id, self.layout))
            self.sock.send_multipart([ident, head, *frames], copy=False)
            self.served += 1
            if ask.last:  # its blocks are read: the lease may go (ipc/kv_leases.py)
                self._table.ack(ask.rank, ask.slot, ask.generation, ask.incarnation)

    def _lease(self, ask: KvFetch) -> str:
        """Why the ask's lease is not held now; "" when it is."""
        if ask.slot < 0:
            return "no lease named"
        try:
            self._table = self._tables.view(self.prefix)
        except KvShareError as e:
            return f"no lease table here to check the lease against: {e}"
        return self._table.check(ask.slot, ask.generation, ask.incarnation)

    def _check(self, ask: KvFetch) -> str:
        n = len(ask.blocks)
        if not 0 < n <= self.max_blocks:
            return f"{n} blocks asked; 1 to {self.max_blocks} per ask"
        if min(ask.blocks) < 0 or max(ask.blocks) >= self.layout.num_blocks:
            return f"a block id outside [0, {self.layout.num_blocks})"
        return ""

    def close(self) -> None:
        self.sock.close(linger=0)


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, in host memory."""
    return memoryview(t.contiguous().cpu().view(torch.uint8).numpy()).cast("B")


@dataclass
class _Fetch:
    msg: KvImport
    addr: str
    sock: zmq.Socket
    started: float
    done: int = 0  # blocks copied so far
    ask_id: int = 0  # the id of the ask now in flight
    size: int = 0  # its blocks


class Fetches:
    """A decode worker's imports from remote sources, in flight."""

    def __init__(
        self, socks: Sockets, poller: zmq.Poller, rank: int, world: int,
        timeout: float = FETCH_TIMEOUT_S,
    ) -> None:  # fmt: skip
        self.socks = socks
        self.timeout = timeout
        self.poller = poller
        self.rank = rank
        self.world = world
        self._socks: dict[str, zmq.Socket] = {}  # address -> DEALER, made on first use
        self._pending: dict[int, _Fetch] = {}  # ask id -> its fetch
        self._per_peer: dict[str, int] = {}  # address -> its fetches in flight
        self._next = 1
        self._decode = msgspec.msgpack.Decoder(KvBlocks)
        self._encode = msgspec.msgpack.Encoder()
        self.refused = 0  # answers dropped: malformed, unknown (late) or not as asked

    @property
    def sockets(self) -> list[zmq.Socket]:
        return list(self._socks.values())

    def start(self, caches: list[KVCache], msg: KvImport, now: float) -> KvImported | None:
        """Send the first ask; the answer when it cannot be made, else None (in flight)."""
        error = self._check(caches, msg)
        if error:
            return KvImported(msg.import_id, self.rank, False, 0.0, error)
        addr = msg.source.split(",")[self.rank]
        if self._per_peer.get(addr, 0) >= MAX_FETCHES_PER_PEER:
            error = f"{addr}: {MAX_FETCHES_PER_PEER} fetches in flight already"
            return KvImported(msg.import_id, self.rank, False, 0.0, error)
        sock = self._socks.get(addr)
        if sock is None:
            try:  # no key file here (ValueError), a bad host name (ZMQError), ...
                sock = self.socks.connect(zmq.DEALER, addr, SNDHWM=MAX_FETCHES_PER_PEER)
            except (ValueError, OSError, zmq.ZMQError) as e:
                return KvImported(msg.import_id, self.rank, False, 0.0, f"{addr}: {e}")
            self._socks[addr] = sock
            self.poller.register(sock, zmq.POLLIN)
        f = _Fetch(msg, addr, sock, now)
        self._per_peer[addr] = self._per_peer.get(addr, 0) + 1
        error = self._ask(f, caches)
        return self._end(f, now, error) if error else None

    def _check(self, caches: list[KVCache], msg: KvImport) -> str:
        addrs = msg.source.split(",")
        if len(addrs) > MAX_SOURCE_RANKS or not all(KV_ADDR_RE.fullmatch(a) for a in addrs):
            return f"not a KV source: {msg.source[:80]!r}"
        if len(addrs) != self.world:
            return f"a source of {len(addrs)} ranks for {self.world} here"
        if msg.slot < 0:
            return "no lease named: nothing for the source to check the copy against"
        n = len(msg.src_blocks)
        limit = layout_of(caches).num_blocks
        if n == 0 or n != len(msg.dst_blocks) or len(set(msg.dst_blocks)) != n:
            return f"{n} source blocks for {len(msg.dst_blocks)} destinations"
        if min(msg.dst_blocks) < 0 or max(msg.dst_blocks) >= limit:
            return f"a block id outside [0, {limit})"
        return ""

    def _ask(self, f: _Fetch, caches: list[KVCache]) -> str:
        """Send the fetch's next ask; why it could not be sent, or ""."""
        per_ask = blocks_per_ask(self.socks.ipc.max_message_bytes, layout_of(caches))
        f.ask_id, self._next = self._next, self._next + 1
        f.size = min(per_ask, len(f.msg.src_blocks) - f.done)
        m = f.msg
        last = f.done + f.size == len(m.src_blocks)
        ask = KvFetch(f.ask_id, m.src_blocks[f.done : f.done + f.size], m.slot, m.generation,
                      m.incarnation, self.rank, last)  # fmt: skip
        try:
            f.sock.send(self._encode.encode(ask), zmq.NOBLOCK)
        except zmq.Again:
            return f"{f.addr} takes no more asks now (not reading, or not reachable)"
        except zmq.ZMQError as e:
            return f"{f.addr}: {e}"
        self._pending[f.ask_id] = f
        return ""

    def on_events(self, events: dict, caches: list[KVCache], now: float) -> list[KvImported]:
        """Take the answers that came; the imports they end (made or failed), and those
        whose time ran out."""
        if not self._pending and not any(s in events for s in self._socks.values()):
            return []  # the usual turn; a late answer must still be read (else it polls on)
        answers: list[KvImported] = []
        for sock in self._socks.values():
            if sock not in events:
                continue
            while has_message(sock):
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                done = self._answer(frames, caches, now)
                if done is not None:
                    answers.append(done)
        for ask_id, f in list(self._pending.items()):
            if now - f.started > self.timeout:
                del self._pending[ask_id]
                answers.append(self._end(f, now, f"no answer within {self.timeout:g} s"))
        return answers

    def _answer(self, frames: list, caches: list[KVCache], now: float) -> KvImported | None:
        try:
            head = self._decode.decode(frames[0].buffer)
        except msgspec.DecodeError:
            self.refused += 1
            return None
        f = self._pending.pop(head.fetch_id, None)
        if f is None:
            self.refused += 1  # late (its fetch failed already), or never asked
            return None
        if head.error:
            return self._end(f, now, f"{f.addr} refused the ask: {head.error}")
        error = self._check_frames(head, frames[1:], caches, f.size)
        if error:
            self.refused += 1
            return self._end(f, now, f"{f.addr}: {error}")
        device = caches[0][0].device
        d_idx = torch.tensor(f.msg.dst_blocks[f.done : f.done + f.size], dtype=torch.long,
                             device=device)  # fmt: skip
        it = iter(frames[1:])
        with warnings.catch_warnings():  # torch warns of a buffer it may not write: it reads
            warnings.simplefilter("ignore", UserWarning)
            for k, v in caches:
                for cache in (k, v):
                    raw = torch.frombuffer(next(it).buffer, dtype=torch.uint8)
                    blocks = raw.view(cache.dtype).view(f.size, *cache.shape[1:])
                    cache.index_copy_(0, d_idx, blocks.to(device))
        f.done += f.size
        if f.done < len(f.msg.src_blocks):
            error = self._ask(f, caches)
            return self._end(f, now, error) if error else None
        return self._end(f, now, "")

    def _check_frames(self, head: KvBlocks, frames: list, caches: list[KVCache], size: int) -> str:
        mine = layout_of(caches)
        if head.layout is None or not head.layout.same_blocks(mine):
            return f"the KV source has another layout: {head.layout} vs {mine}"
        if len(frames) != 2 * mine.num_layers:
            return f"{len(frames)} frames for {mine.num_layers} layers"
        want = size * block_bytes(mine)
        if any(len(fr.buffer) != want for fr in frames):
            return f"a frame not of {want} bytes"
        return ""

    def _end(self, f: _Fetch, now: float, error: str) -> KvImported:
        """The fetch's answer (made unless `error`); its peer has one fetch less in flight."""
        left = self._per_peer.get(f.addr, 0) - 1
        if left > 0:
            self._per_peer[f.addr] = left
        else:
            self._per_peer.pop(f.addr, None)
        return KvImported(f.msg.import_id, self.rank, not error, now - f.started, error)

    def close(self) -> None:
        for sock in self._socks.values():
            self.poller.unregister(sock)
            sock.close(linger=0)
        self._socks.clear()
        self._per_peer.clear()
