"""The engine as the frontend's HTTP and ZMQ paths see it: submit, capacity, abort, drain.

`EngineClient` (one engine, `engine_client.py`) and `EngineGroup` (several behind
one router, `engine_group.py`) are both an `Engine`: the request pipeline,
`ChoiceGroup`, the server's routes and drain, and the launcher's liveness probe
use nothing else of them. `tests/test_frontend.py` checks that both satisfy it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from subway.frontend.engine_client import RequestStream
from subway.ipc.messages import AddLora, EngineReady, EngineStats, RemoveLora, SamplingParams


@runtime_checkable
class EngineLink(Protocol):
    """The frontend's view of its link to the scheduler(s): readiness, health, figures."""

    @property
    def ready(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def error(self) -> str | None: ...

    @property
    def info(self) -> EngineReady | None: ...

    @property
    def stats(self) -> EngineStats | None: ...

    @property
    def num_rejected(self) -> int: ...


@runtime_checkable
class Engine(Protocol):
    """What the frontend asks of the engine behind it."""

    draining: bool  # set by the SIGTERM drain: new requests are refused

    @property
    def link(self) -> EngineLink: ...

    @property
    def num_in_flight(self) -> int: ...

    def check_capacity(self, n: int, tokens: int = 0) -> None:
        """Raise QueueFullError if `n` more requests of `tokens` prompt tokens may not wait."""

    def submit(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, **options: Any
    ) -> RequestStream:
        """Send one request; its deltas come through the stream (EngineDeadError if none can
        serve)."""

    def abort_all(self) -> int:
        """Abort every request in flight; how many."""

    def send_lora(self, msg: AddLora | RemoveLora) -> None:
        """Tell every scheduler of a LoRA adapter served from now on, or no longer."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...
