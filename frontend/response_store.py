"""The Responses API's memory: stored responses (`store: true`), for `GET`, `DELETE`,
`previous_response_id` and background runs, bounded in count, bytes and age.

An entry holds the response as it was answered and its conversation (`history`:
every input item of the chain that led to it, then its output items), so that a
response continuing it (`previous_response_id`) needs only this one entry, never a
walk of a chain whose older links may have been evicted. The oldest entries go first
when a bound is reached (`--responses-store-max`, `--responses-store-bytes`,
`--responses-store-ttl`); an entry larger than the byte bound is not kept. Nothing
is written to disk: a restart forgets every response.

A background response (`background: true`) is an entry whose run is in flight: its
`task` ends it, `cancel` aborts it (its status becomes "cancelled").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Stored:
    response: dict  # the Response object, as the API answers it
    history: list[dict]  # the conversation: the chain's input items, then this one's output
    input_items: list[dict]  # this request's own input items (GET .../input_items)
    size: int = 0  # bytes, as JSON
    at: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None  # a background run in flight


def json_size(*objs: object) -> int:
    return sum(len(json.dumps(o, separators=(",", ":"))) for o in objs)


class ResponseStore:
    """Responses by id, oldest first, within `max_items`, `max_bytes` and `ttl` seconds
    (0: no age limit). `max_items` 0: nothing is stored."""

    def __init__(self, max_items: int, max_bytes: int, ttl: float) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    @property
    def enabled(self) -> bool:
        return self.max_items > 0

    def put(self, entry: Stored) -> bool:
        """Keep `entry` under its response's id (replacing an earlier state of it); False
        when it is larger than the byte bound by itself (then it is not kept)."""
        rid = entry.response["id"]
        self.remove(rid)
        entry.size = json_size(entry.response, entry.history, entry.input_items)
        entry.at = time.monotonic()
        if not self.enabled or entry.size > self.max_bytes:
            return False
        self.entries[rid] = entry
        self.bytes += entry.size
        self._bound()
        return True

    def get(self, rid: str) -> Stored | None:
        self._expire()
        return self.entries.get(rid)

    def remove(self, rid: str) -> Stored | None:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def _bound(self) -> None:
        self._expire()
        while self.entries and (len(self.entries) > self.max_items or self.bytes > self.max_bytes):
            oldest = next(iter(self.entries))
            if self.entries[oldest].task is not None and not self.entries[oldest].task.done():
                self.entries.move_to_end(oldest)  # a run in flight is not evicted
                if all(e.task is not None and not e.task.done() for e in self.entries.values()):
                    break
                continue
            self.remove(oldest)
            self.evicted += 1

    def _expire(self) -> None:
        if not self.ttl:
            return
        now = time.monotonic()
        while self.entries:
            oldest = next(iter(self.entries))
            entry = self.entries[oldest]
            if now - entry.at <= self.ttl or (entry.task is not None and not entry.task.done()):
                break
            self.remove(oldest)
            self.evicted += 1
