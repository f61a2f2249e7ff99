"""CurveZMQ keys for the internal plane over tcp://: one key pair per engine.

Every binding socket is a CURVE server with the pair; every connecting socket uses the
same pair as its own and the pair's public key as the server's. A ZAP handler in each
binding process admits only that public key, so a peer must hold the secret key (the
key file) to connect at all, and everything on the wire is encrypted.

The key file is pyzmq's secret certificate format (`zmq.auth.load_certificate` reads
it; `zmq.auth.create_certificates` writes one we read), mode 0600, owned by this user.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass

import zmq

from subway.ipc.config import IpcConfig

log = logging.getLogger("subway.ipc")

KEY_FLAG = "--curve-key-file"
KEY_FILE_NAME = "curve.key"  # what `serve` writes into the run folder
ZAP_DOMAIN = "subway"  # set on every CURVE server socket; the handler knows only this one
_BANNER = (
    "#   ****  Subway CurveZMQ key pair for one engine's internal sockets  ****\n"
    "#   Anyone holding this file can join the engine: keep it mode 0600.\n"
)
_KEY = re.compile(r'^\s*(public|secret)-key\s*=\s*"([^"]*)"\s*$', re.MULTILINE)


class KeyFileError(ValueError):
    """The key file cannot be parsed, or its two keys do not belong together."""


@dataclass(frozen=True)
class KeyPair:
    """Z85-encoded (40 bytes each), as libzmq's CURVE options take them."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"KeyPair(public={self.public.decode()!r})"


def internal_addrs(ipc: IpcConfig) -> tuple[str, ...]:
    addrs = (ipc.scheduler_addr, ipc.frontend_addr, ipc.plan_addr, ipc.result_addr)
    return (*addrs, ipc.kv_addr) if ipc.kv_addr else addrs


def is_tcp(addr: str) -> bool:
    return addr.startswith("tcp://")


def needs_curve(ipc: IpcConfig) -> bool:
    """Whether any internal socket of this engine goes over tcp://."""
    return any(is_tcp(a) for a in internal_addrs(ipc))


def new_keypair() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def write_key_file(path: str, keys: KeyPair | None = None) -> KeyPair:
    """Create `path` (mode 0600 from the first byte; never over an existing file:
    FileExistsError) holding a new key pair, or `keys`."""
    keys = keys or new_keypair()
    text = (
        f"{_BANNER}metadata\ncurve\n"
        f'    public-key = "{keys.public.decode()}"\n'
        f'    secret-key = "{keys.secret.decode()}"\n'
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return keys


def write_public_file(path: str, public: bytes) -> None:
    """Write `public` alone, in pyzmq's public certificate format, to `path` (never over an
    existing file): what a client of the native ZMQ endpoint on tcp:// is given
    (`subway.client.zmq_curve.read_public_key`). Not secret: mode 0644."""
    text = (
        "#   ****  Subway CurveZMQ public key: give it to clients  ****\n"
        f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _check_owner_and_mode(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise PermissionError(f"CurveZMQ key file {path} is not a regular file")
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"CurveZMQ key file {path} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.getuid()})"
        )
    if st.st_mode & 0o077:
        raise PermissionError(
            f"CurveZMQ key file {path} is open to others (mode {st.st_mode & 0o777:o}); "
            f"chmod 600 it"
        )


def load_key_file(path: str) -> KeyPair:
    """The key pair in `path`. PermissionError unless it is a regular file of this user
    that nobody else may read or write (checked on the opened file, so no swap between
    check and read); KeyFileError if its keys are malformed or not one pair."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block us
    with os.fdopen(fd) as f:
        _check_owner_and_mode(path, os.fstat(fd))
        text = f.read(64 << 10)
    found = dict(_KEY.findall(text))
    if set(found) != {"public", "secret"}:
        raise KeyFileError(f"{path} is not a CurveZMQ key file (needs public-key and secret-key)")
    public, secret = found["public"].encode(), found["secret"].encode()
    for name, key in (("public", public), ("secret", secret)):
        if len(key) != 40:
            raise KeyFileError(f"{path}: the {name} key must be 40 Z85 characters")
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as e:
        raise KeyFileError(f"{path}: the secret key is not valid Z85 ({e})") from None
    if derived != public:
        raise KeyFileError(f"{path}: the public key does not belong to the secret key")
    return KeyPair(public, secret)


def engine_keys(ipc: IpcConfig, addr: str) -> KeyPair:
    """The engine's key pair, for a socket on tcp:// `addr`: ValueError naming the flag
    when no key file is given, PermissionError or KeyFileError for a bad one."""
    if not ipc.curve_key_file:
        raise ValueError(
            f"{addr} is a tcp:// address: its sockets need a CurveZMQ key file, given with "
            f"{KEY_FLAG} (make one with `subway keygen FILE`; `subway serve` makes one per run)"
        )
    return load_key_file(ipc.curve_key_file)


def require_key_file(ipc: IpcConfig) -> KeyPair | None:
    """Check, before any socket is made, that a config whose internal addresses include
    tcp:// ones names a usable key file (errors as `engine_keys`); None when none is tcp://."""
    tcp = [a for a in internal_addrs(ipc) if is_tcp(a)]
    return engine_keys(ipc, tcp[0]) if tcp else None


class _OnlyOurKey:
    """ZAP credentials provider: admits the engine's own public key, nothing else."""

    def __init__(self, public: bytes) -> None:
        self.public = public
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.public:
            return True
        self.denied += 1
        # Once at warning level; after that a scanner would only flood the log.
        (log.warning if self.denied == 1 else log.debug)(
            "refused a CurveZMQ peer with an unknown key (%d so far)", self.denied
        )
        return False


class Authenticator:
    """The ZAP handler of one zmq context (libzmq asks it about every CURVE handshake on a
    server socket of that context), in a thread of its own. Works for zmq.asyncio contexts
    too: it talks to libzmq through a plain context that shadows theirs."""

    def __init__(self, ctx: zmq.Context, public: bytes) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.provider = _OnlyOurKey(public)
        self._auth = ThreadAuthenticator(
            zmq.Context.shadow(ctx.underlying), log=log.getChild("zap")
        )
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.provider)
        self._auth.start()

    def stop(self) -> None:
        self._auth.stop()
