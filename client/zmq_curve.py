"""CurveZMQ for the native endpoint on tcp://: the keys both sides derive and read.

Over tcp:// the endpoint is a CURVE server (its key pair: the frontend's
`--client-curve-key-file`), and a client must know its public key to connect at all
(`read_public_key`: a file, `FILE.pub` beside the server's key file, never the
secret). Everything on the wire is encrypted, the API key included.

The client's own key pair stands for the API key (`client_keys`): its secret is
a hash of the API key and the server's public key, so the endpoint, which knows
both, admits that one public key in the handshake (a ZAP handler) and nothing
else. A peer without the API key is turned away before it can send a byte of a
message, so nothing of it is buffered or decoded, and the key itself never
crosses the wire (only a proof of it does, inside the handshake). A server
without an API key admits any client key, as its HTTP door admits any request.

This module imports only pyzmq (and the standard library), like the rest of
`subway.client`.
"""

from __future__ import annotations

import hashlib
import re

import zmq
from zmq.utils import z85

_PERSON = b"subway-zmq-key/1"  # blake2b's personalisation: at most 16 bytes
_KEY_LINE = re.compile(r'^\s*(public|secret)-key\s*=\s*"([^"]*)"\s*$', re.MULTILINE)
_MAX_FILE_BYTES = 64 << 10
Z85_KEY_CHARS = 40


class ServerKeyError(ValueError):
    """The server key file cannot be used: malformed, or it holds a secret key."""


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def client_keys(api_key: str, server_public: bytes) -> tuple[bytes, bytes]:
    """(public, secret), Z85-encoded: the client key pair `api_key` stands for at the
    server whose public key is `server_public`; with no API key, a fresh pair."""
    if not api_key:
        public, secret = zmq.curve_keypair()
        return public, secret
    seed = hashlib.blake2b(
        api_key.encode(), digest_size=32, key=server_public, person=_PERSON
    ).digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def _check_key(key: str, path: str) -> bytes:
    raw = key.encode()
    if len(raw) != Z85_KEY_CHARS:
        raise ServerKeyError(f"{path}: a public key is {Z85_KEY_CHARS} Z85 characters")
    try:
        z85.decode(raw)
    except (ValueError, KeyError, IndexError):
        raise ServerKeyError(f"{path}: the public key is not valid Z85") from None
    return raw


def read_public_key(path: str) -> bytes:
    """The server's public key from `path`: pyzmq's public certificate format (what
    `subway keygen FILE` writes as FILE.pub, `zmq.auth.create_certificates` as NAME.key)
    or the 40 Z85 characters alone. A file holding a secret key is refused
    (ServerKeyError): the server's secret key has no business on a client."""
    with open(path, encoding="ascii", errors="replace") as f:
        text = f.read(_MAX_FILE_BYTES)
    found = dict(_KEY_LINE.findall(text))
    if "secret" in found:
        raise ServerKeyError(
            f"{path} holds a secret key: give a client only the server's public key "
            f"(FILE.pub, made by `subway keygen FILE`)"
        )
    if "public" in found:
        return _check_key(found["public"], path)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if len(lines) != 1:
        raise ServerKeyError(f"{path} is not a CurveZMQ public key file (no public-key line)")
    return _check_key(lines[0], path)


def curve_client_options(api_key: str, server_public: bytes) -> dict[int, bytes]:
    """The socket options a client's DEALER sets before it connects."""
    public, secret = client_keys(api_key, server_public)
    return {
        zmq.CURVE_SERVERKEY: server_public,
        zmq.CURVE_PUBLICKEY: public,
        zmq.CURVE_SECRETKEY: secret,
    }
