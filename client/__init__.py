"""Python clients for a running Subway, apart from the server: they import no server code.

- `Client` (blocking) and `AsyncClient` (asyncio), for the frontend's native ZMQ
  endpoint (`zmq_client.py`), over the messages of `protocol.py`;
- `HTTPClient`, a small helper over the OpenAI-compatible HTTP API (`http_client.py`).
"""

from subway.client.http_client import HTTPClient
from subway.client.protocol import GenerateOutput, RequestError
from subway.client.zmq_client import AsyncClient, Client, Completion

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "GenerateOutput",
    "HTTPClient",
    "RequestError",
]
