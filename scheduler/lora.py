"""The scheduler's view of LoRA adapters: which are served, how many requests each has, and
which may run in the next step.

Adapters are planned like KV blocks: a step's sequences use at most `--max-loras` distinct
adapters (the workers hold that many in their step's stacks). The rule is kept over the
running requests (every running request is in every step): a waiting request whose adapter
is not running while `--max-loras` others are waits, and admission stops behind it (no
overtaking, as for blocks), so the running adapters drain and it gets the next one; its
wait is bounded by the time the running requests of one adapter take to finish.

Adapters of `--lora-modules` have ids 1..n in the order given (the frontend and the
workers number them alike from the same config); the frontend announces later ones
(`AddLora`). A removed adapter (`RemoveLora`) takes no new requests; its requests in
flight finish first, then the workers are told to forget it (`Plan.loras_removed`).
"""

from __future__ import annotations

from subway.ipc.config import LoraConfig
from subway.ipc.lora_messages import startup_adapters
from subway.ipc.messages import EngineStats, LoraAdapter, Plan


class LoraTable:
    def __init__(self, config: LoraConfig) -> None:
        self.enabled = config.enable_lora
        self.max_loras = config.max_loras
        self.adapters: dict[int, LoraAdapter] = {a.lora_id: a for a in startup_adapters(config)}
        self.removing: set[int] = set()  # removed, with requests still in flight
        self.live: dict[int, int] = {}  # requests (waiting or running) per adapter
        self.running: dict[int, int] = {}  # running requests per adapter
        self._added: list[LoraAdapter] = []  # for the next plan (`take_changes`)
        self._dropped: list[int] = []

    def add(self, adapter: LoraAdapter) -> bool:
        """Serve `adapter` from now on; False (and nothing changes) if its id is taken or
        LoRA is off."""
        if not self.enabled or adapter.lora_id <= 0 or adapter.lora_id in self.adapters:
            return False
        self.adapters[adapter.lora_id] = adapter
        self._added.append(adapter)
        return True

    def remove(self, lora_id: int) -> None:
        """Take no more requests for it; the workers forget it once its requests are done."""
        if lora_id not in self.adapters or lora_id in self.removing:
            return
        self.removing.add(lora_id)
        if not self.live.get(lora_id):
            self._drop(lora_id)

    def accepts(self, lora_id: int) -> bool:
        """Whether a new request may name this adapter (0: the base model)."""
        return lora_id == 0 or (lora_id in self.adapters and lora_id not in self.removing)

    def joined(self, lora_id: int) -> None:
        """A request of this adapter was queued."""
        if lora_id:
            self.live[lora_id] = self.live.get(lora_id, 0) + 1

    def left(self, lora_id: int) -> None:
        """A request of this adapter finished (or was aborted)."""
        if not lora_id:
            return
        n = self.live[lora_id] - 1
        if n:
            self.live[lora_id] = n
            return
        del self.live[lora_id]
        if lora_id in self.removing:
            self._drop(lora_id)

    def can_run(self, lora_id: int) -> bool:
        """Whether a request of this adapter may join the running requests now."""
        return not lora_id or lora_id in self.running or len(self.running) < self.max_loras

    def started(self, lora_id: int) -> None:
        if lora_id:
            self.running[lora_id] = self.running.get(lora_id, 0) + 1

    def stopped(self, lora_id: int) -> None:
        if lora_id:
            n = self.running[lora_id] - 1
            if n:
                self.running[lora_id] = n
            else:
                del self.running[lora_id]

    def announce(self, plan: Plan) -> None:
        """Put the adapters added and dropped since the last plan into this one."""
        if self._added or self._dropped:
            plan.loras, plan.loras_removed = self._added, self._dropped
            self._added, self._dropped = [], []

    def report(self, stats: EngineStats) -> None:
        """Adapters served and requests per adapter, into the engine's stats."""
        if self.enabled:
            stats.lora_adapters = len(self.adapters) - len(self.removing)
            stats.lora_requests = dict(self.live)

    def _drop(self, lora_id: int) -> None:
        self.removing.discard(lora_id)
        del self.adapters[lora_id]
        self._dropped.append(lora_id)
