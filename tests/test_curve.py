"""CurveZMQ on the internal plane: only a holder of the engine's key file gets in over tcp://."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
import time

import httpx
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from subway.ipc import curve
from subway.ipc.config import EngineConfig
from subway.ipc.sockets import Sockets
from subway.tools.launch import own_curve_keys

from serving import KV_BLOCKS, Server, free_port

FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@pytest.fixture
def key_file(tmp_path) -> str:
    path = str(tmp_path / "engine.key")
    curve.write_key_file(path)
    return path


_made: list[Sockets] = []


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    while _made:  # so that a failed test still stops its ZAP handlers, and term returns
        _made.pop().close()
    c.destroy(linger=0)


def _socks(ctx: zmq.Context, config: EngineConfig) -> Sockets:
    socks = Sockets(ctx, config.ipc)
    _made.append(socks)
    return socks


def _ipc(key_file: str = "") -> EngineConfig:
    return EngineConfig.build(curve_key_file=key_file)


def _loopback() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _intruder(ctx: zmq.Context, kind: int, server_key: bytes | None) -> zmq.Socket:
    """A socket with no key (None) or with a key pair of its own, which knows the engine's
    public key (`server_key`): the strongest outsider, short of the secret key."""
    sock = ctx.socket(kind)
    sock.linger = 0
    if server_key is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_key
    return sock


def _wait_for_event(mon: zmq.Socket, events: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mon.poll(100):
            event = recv_monitor_message(mon)["event"]
            if event & events:
                return event
    raise AssertionError(f"no event in {events:#x} within {timeout}s")


def _refused(ctx: zmq.Context, kind: int, addr: str, server_key: bytes | None) -> zmq.Socket:
    """An intruder whose handshake has been seen to fail (from its own side)."""
    sock = _intruder(ctx, kind, server_key)
    mon = sock.get_monitor_socket(FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(addr)  # after the monitor, so that no event is missed
    try:
        assert _wait_for_event(mon, FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED) & FAILED
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
    return sock


def _try_send(sock: zmq.Socket, data: bytes) -> None:
    """Send if the socket will queue it at all (a refused PUSH often has no pipe left)."""
    with contextlib.suppress(zmq.Again):
        sock.send(data, zmq.NOBLOCK)


# ------------------------------------------------------------------ the sockets


def test_a_keyed_push_reaches_a_curve_pull_and_no_other_does(ctx, key_file):
    config, addr = _ipc(key_file), _loopback()
    server, client = _socks(ctx, config), _socks(ctx, config)
    pull = server.bind(zmq.PULL, addr)
    public = curve.load_key_file(key_file).public
    plain = _refused(ctx, zmq.PUSH, addr, None)
    stranger = _refused(ctx, zmq.PUSH, addr, public)
    _try_send(plain, b"forged")
    _try_send(stranger, b"forged")
    push = client.connect(zmq.PUSH, addr)
    push.send(b"plan")
    assert pull.poll(10_000) and pull.recv() == b"plan"
    assert pull.get(zmq.MECHANISM) == zmq.CURVE and push.get(zmq.MECHANISM) == zmq.CURVE
    assert not pull.poll(300), "a peer without the engine's key delivered a message"
    assert server.denied >= 1  # the stranger's key was refused (and counted for /metrics)
    for s in (pull, push, plain, stranger):
        s.close()
    server.close()
    client.close()


def test_a_plain_sub_gets_no_plan_from_a_curve_xpub(ctx, key_file):
    config, addr = _ipc(key_file), _loopback()
    socks = _socks(ctx, config)
    xpub = socks.bind(zmq.XPUB, addr, XPUB_VERBOSE=1)
    plain = _refused(ctx, zmq.SUB, addr, None)
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    stranger = _refused(ctx, zmq.SUB, addr, curve.load_key_file(key_file).public)
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    sub = _socks(ctx, config).connect(zmq.SUB, addr)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    assert xpub.poll(10_000) and xpub.recv() == b"\x01"  # the keyed worker's subscription
    xpub.send(b"plan 1")
    assert sub.poll(10_000) and sub.recv() == b"plan 1"
    assert not plain.poll(300) and not stranger.poll(0), "an intruder read a plan"
    assert not xpub.poll(0), "an intruder's subscription reached the scheduler"
    for s in (xpub, plain, stranger, sub):
        s.close()
    socks.close()


def test_an_asyncio_context_authenticates_too(key_file):
    """The frontend's sockets live in a zmq.asyncio context."""

    async def run() -> None:
        actx = zmq.asyncio.Context()
        config, addr = _ipc(key_file), _loopback()
        socks = Sockets(actx, config.ipc)
        pull = socks.bind(zmq.PULL, addr)
        sync = zmq.Context()
        stranger = _refused(sync, zmq.PUSH, addr, curve.load_key_file(key_file).public)
        _try_send(stranger, b"forged")
        push = Sockets(sync, config.ipc).connect(zmq.PUSH, addr)
        push.send(b"delta")
        assert await asyncio.wait_for(pull.recv(), 10) == b"delta"
        assert not await pull.poll(300)
        for s in (pull, push, stranger):
            s.close(linger=0)
        socks.close()
        sync.term()
        actx.term()

    asyncio.run(run())


def test_close_lets_the_context_terminate_and_ipc_starts_no_handler(key_file, tmp_path):
    config = _ipc(key_file)
    threads = threading.active_count()
    ctx = zmq.Context()
    socks = Sockets(ctx, config.ipc)
    s = socks.bind(zmq.PULL, f"ipc://{tmp_path}/a.sock")
    assert threading.active_count() == threads, "an ipc:// bind started a ZAP handler"
    t = socks.bind(zmq.PULL, _loopback())
    assert threading.active_count() > threads
    s.close()
    t.close()
    socks.close()
    socks.close()  # idempotent
    done = threading.Thread(target=ctx.term, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive(), "ctx.term() hung after Sockets.close()"


@pytest.mark.parametrize("side", ["bind", "connect"])
def test_a_tcp_address_without_a_key_file_is_refused(ctx, side):
    socks = Sockets(ctx, _ipc().ipc)
    with pytest.raises(ValueError, match="--curve-key-file"):
        getattr(socks, side)(zmq.PULL, _loopback())


def test_ipc_addresses_need_no_key(ctx, tmp_path):
    socks = Sockets(ctx, _ipc().ipc)
    addr = f"ipc://{tmp_path}/b.sock"
    pull, push = socks.bind(zmq.PULL, addr), socks.connect(zmq.PUSH, addr)
    push.send(b"x")
    assert pull.poll(10_000) and pull.recv() == b"x"
    pull.close()
    push.close()


# ------------------------------------------------------------------ the key file


def test_the_key_file_is_made_0600_and_never_over_another(tmp_path):
    path = str(tmp_path / "k")
    keys = curve.write_key_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert curve.load_key_file(path) == keys
    assert keys.secret.decode() not in repr(keys)
    with pytest.raises(FileExistsError):
        curve.write_key_file(path)
    assert curve.load_key_file(path) == keys


def test_the_key_file_is_pyzmqs_certificate_format(tmp_path):
    ours = str(tmp_path / "ours")
    keys = curve.write_key_file(ours)
    assert zmq.auth.load_certificate(ours) == (keys.public, keys.secret)
    _, secret_file = zmq.auth.create_certificates(str(tmp_path), "theirs")
    os.chmod(secret_file, 0o600)
    assert curve.load_key_file(secret_file).public == zmq.auth.load_certificate(secret_file)[0]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_key_file_others_may_touch_is_refused(key_file, mode):
    os.chmod(key_file, mode)
    with pytest.raises(PermissionError, match="chmod 600"):
        curve.load_key_file(key_file)


def test_a_key_file_of_another_user_is_refused(key_file, monkeypatch):
    owner = os.stat(key_file).st_uid
    monkeypatch.setattr(curve.os, "getuid", lambda: owner + 1)
    with pytest.raises(PermissionError, match="not to this user"):
        curve.load_key_file(key_file)


def test_a_key_file_that_is_not_a_regular_file_is_refused(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    with pytest.raises(PermissionError, match="regular file"):
        curve.load_key_file(fifo)


def test_malformed_key_files_are_refused(tmp_path):
    a, b = zmq.curve_keypair(), zmq.curve_keypair()
    bodies = {
        "empty": "",
        "no secret": f'curve\n    public-key = "{a[0].decode()}"\n',
        "short": 'curve\n    public-key = "abc"\n    secret-key = "def"\n',
        "not one pair": f'curve\n    public-key = "{a[0].decode()}"\n'
        f'    secret-key = "{b[1].decode()}"\n',
    }
    for name, body in bodies.items():
        path = str(tmp_path / name.replace(" ", "_"))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, body.encode())
        os.close(fd)
        with pytest.raises(curve.KeyFileError):
            curve.load_key_file(path)


# ------------------------------------------------------------------ the launcher


def test_serve_makes_a_key_file_only_for_tcp(tmp_path):
    run_dir = str(tmp_path)
    plain = EngineConfig.build(run_dir=run_dir)
    assert own_curve_keys(plain) == (plain, None)
    tcp = EngineConfig.build(run_dir=run_dir, plan_addr=_loopback())
    keyed, made = own_curve_keys(tcp)
    assert made == os.path.join(run_dir, curve.KEY_FILE_NAME) == keyed.ipc.curve_key_file
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o600
    curve.load_key_file(made)
    with pytest.raises(FileExistsError, match="--curve-key-file"):
        own_curve_keys(tcp)  # never over a file that is there
    given = tcp.replace(curve_key_file=made)
    assert own_curve_keys(given) == (given, None)


def test_serve_refuses_an_open_key_file_before_starting_anything(key_file, tmp_path, capsys):
    from subway.tools import launch

    os.chmod(key_file, 0o644)
    config = EngineConfig.build(
        run_dir=str(tmp_path / "run"), result_addr=_loopback(), curve_key_file=key_file
    )
    assert launch.serve(config) == 1
    assert "chmod 600" in capsys.readouterr().err
    assert not os.path.exists(config.ipc.run_dir)  # the folder it made is gone again


def test_serve_over_tcp_answers_and_leaves_no_key_file(tiny_models):
    """The whole engine with every internal socket on tcp://: greedy output equals
    transformers', intruders on the plan and result ports get nowhere, and the run's key
    file lives (0600) while it serves and goes with it."""
    from transformers import AutoTokenizer

    from reference import hf_greedy

    addrs = {name: _loopback() for name in ("scheduler", "frontend", "plan", "result")}
    flags = [x for name, a in addrs.items() for x in (f"--{name}-addr", a)]
    server = Server(tiny_models["llama"], "--served-model-name", "tiny", *flags, *KV_BLOCKS)
    run_dir = EngineConfig.build(run_id=server.run_id).ipc.run_dir
    key_path = os.path.join(run_dir, curve.KEY_FILE_NAME)
    ctx = zmq.Context()
    try:
        assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
        public = curve.load_key_file(key_path).public
        intruders = [
            _refused(ctx, kind, addrs[port], key)
            for kind, port in ((zmq.SUB, "plan"), (zmq.PUSH, "result"))
            for key in (None, public)
        ]
        for s in intruders[2:]:
            _try_send(s, b"\x93\x00\x00\x00")  # a forged result goes nowhere
        prompt = "Subway trains run every few minutes because"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        body["ignore_eos"] = True
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "length"
        tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert out["text"] == tok.decode(hf_greedy(tiny_models["llama"], ids, 8).tokens)
        assert not any(s.poll(0) for s in intruders[:2]), "an intruder read a plan"
        assert server.healthy()
        for s in intruders:
            s.close()
    finally:
        code = server.stop()
        ctx.term()
    assert code == 0, server.read_output()
    assert not os.path.exists(key_path) and not os.path.exists(run_dir)
