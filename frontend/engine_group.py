"""The frontend's engines: one `EngineClient` per data-parallel engine, behind the one
surface the request pipeline uses (`submit`, `check_capacity`, `link`, draining).

Each engine is a scheduler and its tensor-parallel workers, with sockets and shared
memory of its own (`ipc.config.engine_config`). A request goes to the engine the
`PrefixRouter` picks among those that can serve now; its stream stays with that
engine's client. An engine that fails fails only its own requests: the others serve
on, and `/health` stays 200 (saying "degraded") while at least one can serve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from subway.frontend.engine_client import EngineClient, QueueFullError, RequestStream
from subway.frontend.handoff import HandoffStream, can_hand_off
from subway.frontend.router import Load, PrefixRouter, Route
from subway.frontend.scheduler_link import EngineDeadError
from subway.ipc.config import EngineConfig
from subway.ipc.messages import AddLora, EngineReady, EngineStats, RemoveLora, SamplingParams


class EngineGroup:
    def __init__(self, config: EngineConfig, **client_options) -> None:
        """`client_options`: passed to every `EngineClient` (heartbeat_timeout, fail_after)."""
        self.config = config
        n = max(1, config.parallel.data_parallel_size)
        engines = [config.engine(i) for i in range(n)]
        self.clients = [EngineClient(e, **client_options) for e in engines]
        self.roles = [e.parallel.role for e in engines]
        self.router = PrefixRouter(n, config.cache.block_size)
        self.on_route: Callable[[Route], None] = lambda route: None
        self._draining = False
        for i, client in enumerate(self.clients):
            client.link.on_digests = self._digests_of(i)
            forget = self._forget(i, client.link.on_new_scheduler)
            client.link.on_new_scheduler = forget
        self.link = GroupLink(self.clients)

    def _digests_of(self, i: int) -> Callable[[list[int], list[int], bool], None]:
        return lambda stored, removed, reset: self.router.update(i, stored, removed, reset)

    def _forget(self, i: int, then: Callable[[], None]) -> Callable[[], None]:
        def on_new_scheduler() -> None:
            self.router.forget(i)
            then()

        return on_new_scheduler

    # ------------------------------------------------------------ the pipeline's surface

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        for c in self.clients:
            c.draining = value

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    @property
    def num_waiting(self) -> int:
        return sum(c.num_waiting for c in self.clients)

    def serving(self) -> list[EngineClient | None]:
        """Each engine's client if it can take a request now, else None."""
        return [c if c.link.ready and c.link.is_open and c.link.healthy else None
                for c in self.clients]  # fmt: skip

    def check_capacity(self, n: int, tokens: int = 0) -> None:
        """Raise QueueFullError unless some engine that can serve has room for `n` more
        sequences of `tokens` prompt tokens (EngineClient.check_capacity)."""
        error: QueueFullError | None = None
        for c in self.serving():
            if c is None:
                continue
            try:
                c.check_capacity(n, tokens)
                return
            except QueueFullError as e:
                error = e
        if error is not None:
            raise error  # else no engine serves: submit says why

    async def start(self) -> None:
        for c in self.clients:
            await c.start()

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        **options,
    ) -> RequestStream:
        """`EngineClient.submit` on the engine the router picks."""
        if self._draining:
            raise EngineDeadError("the server is shutting down")
        clients = self.clients
        if len(clients) == 1:
            return clients[0].submit(request_id, prompt_ids, sampling, **options)
        if any(c.in_flight(request_id) for c in clients):
            raise ValueError(f"request id {request_id!r} is already in flight")
        serving = self.serving()
        prefill, decode = self._prefill(serving, True), self._prefill(serving, False)
        if any(prefill) and any(decode) and can_hand_off(sampling):
            engine = self._route(prompt_ids, prefill)
            return HandoffStream(
                request_id, prompt_ids, sampling, options, clients[engine],
                lambda prompt: clients[self._route(prompt, self._prefill(self.serving(), False))],
            )  # fmt: skip
        # No split: a decode engine serves it whole (a prefill engine when none is left).
        engine = self._route(prompt_ids, decode if any(decode) else serving)
        return clients[engine].submit(request_id, prompt_ids, sampling, **options)

    def _prefill(self, serving: list[EngineClient | None], yes: bool) -> list[EngineClient | None]:
        """Of `serving`, the prefill engines (`yes`) or all others (decode and whole)."""
        return [c if (r == "prefill") == yes else None
                for c, r in zip(serving, self.roles, strict=True)]  # fmt: skip

    def _route(self, prompt_ids: Sequence[int], candidates: list[EngineClient | None]) -> int:
        """The engine among `candidates` (None: not one) that the router picks."""
        loads = [_load(c) if c is not None else None for c in candidates]
        try:
            route = self.router.choose(prompt_ids, loads)
        except LookupError:
            raise EngineDeadError(self.link.error or "no engine can serve") from None
        self.on_route(route)
        return route.engine

    # `submit` as an async generator: EngineClient's, which only calls `self.submit`.
    generate = EngineClient.generate

    def abort_all(self) -> int:
        return sum(c.abort_all() for c in self.clients)

    def send_lora(self, msg: AddLora | RemoveLora) -> None:
        """A LoRA adapter served from now on, or no longer: every engine is told (any may
        get a request for it)."""
        for c in self.clients:
            c.send_lora(msg)

    def health(self) -> tuple[bool, list[dict]]:
        """(can serve, each engine's state): serving, not ready, silent, or its error."""
        states = []
        for i, c in enumerate(self.clients):
            link = c.link
            if link.healthy:
                state = "serving"
            else:
                state = link.error or ("not ready" if not link.ready else "silent")
            states.append({"engine": i, "role": self.roles[i], "state": state})
        serving = {s["role"] for s in states if s["state"] == "serving"}
        # End to end: a decode (or whole) engine can serve any request; prefill ones alone
        # serve whole requests too.
        return bool(serving), states


def _load(client: EngineClient) -> Load:
    stats = client.link.stats
    kv = stats.kv_blocks_used / max(1, stats.kv_blocks_total) if stats is not None else 0.0
    return Load(client.num_in_flight, client.num_waiting, kv)


class GroupLink:
    """What the pipeline reads of "the engine" through `engine.link`, over all engines:
    ready and healthy if any is; the info of a ready one (all serve the same model);
    the stats of the slowest step; refusals summed."""

    def __init__(self, clients: list[EngineClient]) -> None:
        self._links = [c.link for c in clients]

    @property
    def ready(self) -> bool:
        return any(link.ready for link in self._links)

    @property
    def healthy(self) -> bool:
        return any(link.healthy for link in self._links)

    @property
    def is_open(self) -> bool:
        return any(link.is_open for link in self._links)

    @property
    def info(self) -> EngineReady | None:
        ready = [link.info for link in self._links if link.ready]
        if ready:
            return ready[0]
        return next((link.info for link in self._links if link.info is not None), None)

    @property
    def error(self) -> str | None:
        if self.ready:
            return None
        errors = [f"engine {i}: {link.error}" for i, link in enumerate(self._links) if link.error]
        if len(self._links) == 1:
            return self._links[0].error
        return "; ".join(errors) or None

    @property
    def stats(self) -> EngineStats | None:
        stats = [link.stats for link in self._links if link.stats is not None]
        return max(stats, key=lambda s: s.step_time) if stats else None

    @property
    def all_stats(self) -> list[EngineStats | None]:
        return [link.stats for link in self._links]

    @property
    def num_rejected(self) -> int:
        return sum(link.num_rejected for link in self._links)

    def rejected_of(self, i: int) -> int:
        return self._links[i].num_rejected
