"""torch.distributed listens on the rendezvous host only: loopback unless asked.

torch's TCPStore binds the wildcard address whatever host it is given, so a
`-tp 2` engine's rendezvous store (whose keys the ranks trust when they meet)
was reachable from every network the host is on. `worker/parallel.py` binds the
store's socket itself, and gloo's own sockets follow a loopback rendezvous."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from serving import Server, free_port


def _listening(procs: list[psutil.Process]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket these processes listen on."""
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        out += [(p.pid, *c.laddr) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def test_a_tp2_engine_listens_on_loopback_only(tiny_models):
    """A live `serve -tp 2` (default flags: HTTP on 127.0.0.1, rendezvous on 127.0.0.1):
    no process of it listens on a wildcard or a non-loopback address."""
    server = Server(tiny_models["llama"], "--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        procs = [psutil.Process(server.proc.pid), *server.children()]
        procs += [c for p in server.children() for c in p.children(recursive=True)]
        listening = _listening(procs)
        ports = {port for _, _, port in listening}
        assert server.port in ports and len(ports) >= 2  # HTTP, and the rendezvous store
        exposed = [x for x in listening if not ipaddress.ip_address(x[1]).is_loopback]
        assert not exposed, f"listening beyond loopback: {exposed}"
    finally:
        server.stop()


@pytest.mark.parametrize(
    "addr, expected",
    [
        ("127.0.0.1:29533", ("127.0.0.1", 29533)),
        ("[::1]:4000", ("::1", 4000)),
        ("node-7.example:80", ("node-7.example", 80)),
    ],
)
def test_rendezvous_addresses_parse(addr, expected):
    from subway.worker.parallel import split_host_port

    assert split_host_port(addr) == expected


@pytest.mark.parametrize("addr", ["127.0.0.1", ":29533", "host:port", "host:0", "h:70000", ""])
def test_bad_rendezvous_addresses_are_refused(addr):
    from subway.worker.parallel import split_host_port

    with pytest.raises(ValueError, match="HOST:PORT"):
        split_host_port(addr)


def test_loopback_hosts():
    from subway.worker.parallel import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert not is_loopback("node-7.example")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_store_listens_on_its_host_alone(host):
    import datetime

    from subway.worker.parallel import rendezvous_store

    store = rendezvous_store(host, free_port(host), 1, True, datetime.timedelta(seconds=5))
    store.set("k", "v")
    mine = _listening([psutil.Process()])
    assert [a for _, a, p in mine if p == store.port] == [host]
    del store


def test_a_taken_rendezvous_port_is_a_clear_error():
    import datetime
    import socket

    from subway.worker.parallel import rendezvous_store

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="--dist-init-addr"):
            rendezvous_store("127.0.0.1", port, 2, True, datetime.timedelta(seconds=1))
