"""Slow and surplus HTTP clients, handled below the ASGI app: uvicorn's h11 protocol with
a header read timeout and a connection limit (`guarded_h11`).

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) and can refuse
requests over a concurrency limit, but only once their headers are in: a client
that opens a connection and trickles a byte every few seconds holds it forever.
Here, per connection:

- a timer is armed when the connection is made and again when the first byte of
  each later request arrives; it is cancelled as soon as h11 has parsed the
  request's headers. When it fires, the connection is closed (with a 408 if part
  of a request had come). The same timer runs while a client still sends the
  body of a request that has been answered (an early 413, a body the route never
  read). A timer costs the loop nothing until it fires;
- a connection made while `max_connections` are open is answered with a canned
  503 and closed at once, before anything is parsed.

The body has its own deadline, in the ASGI guard (`middleware.py`), since the
app decides when it reads it.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _canned(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style error body and `Connection: close`."""
    body = json.dumps(
        {"error": {"message": message, "type": "service_unavailable" if status == 503
                   else "invalid_request_error", "param": None, "code": status}}
    ).encode()  # fmt: skip
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a header read timeout and a connection limit (class attributes,
    set by `guarded_h11`)."""

    header_timeout: float = 10.0  # 0: no limit
    max_connections: int = 0  # 0: no limit
    refused = b""
    timed_out = b""

    _header_timer: asyncio.TimerHandle | None = None
    _partial = False  # bytes of a request whose headers are not complete have come

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            transport.write(self.refused)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._waiting_on_client():
            self._arm()
        self._partial = True
        super().data_received(data)
        if self._header_timer is not None and not self._waiting_on_client():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        # The next request's clock starts at its first byte (until then uvicorn's
        # keep-alive timeout holds); a pipelined one already read is timed from now.
        super().on_response_complete()
        if self._waiting_on_client() and (
            self.conn.trailing_data[0] or self.conn.their_state is h11.SEND_BODY
        ):
            self._arm()

    def _waiting_on_client(self) -> bool:
        """Nothing of this connection is in the app's hands: h11 waits for a request's
        headers, or for the rest of the body of a request already answered."""
        if self.transport.is_closing():
            return False
        their = self.conn.their_state
        if their is h11.IDLE:
            return True
        return their is h11.SEND_BODY and self.conn.our_state in (h11.DONE, h11.MUST_CLOSE)

    def _arm(self) -> None:
        self._disarm()
        self._partial = False
        if self.header_timeout <= 0:  # no limit
            return
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if not self._waiting_on_client():
            return
        if self.conn.their_state is h11.IDLE and (self._partial or self.conn.trailing_data[0]):
            self.transport.write(self.timed_out)
        self.transport.close()


def guarded_h11(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class to pass as `http=` to `uvicorn.Config`."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout": header_timeout,
            "max_connections": max_connections,
            "refused": _canned(
                503, "Service Unavailable",
                f"too many open connections (at most {max_connections})",
            ),
            "timed_out": _canned(
                408, "Request Timeout",
                f"the request headers did not arrive within {header_timeout:g} s",
            ),
        },
    )  # fmt: skip
