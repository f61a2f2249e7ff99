"""Whether an engine's workers are working, read from /proc (`WorkWatch`): the evidence the
scheduler's `WorkerLink` weighs before it declares a step, or an idle worker, hung."""

from __future__ import annotations

import os
from collections.abc import Callable

from subway.ipc.messages import WorkerReady
from subway.ipc.peers import this_host

PEER_CHECK_S = 1.0  # how often the workers' pids are checked (and their /proc sampled)
ACTIVE_CPU_S = 0.02  # CPU time a worker uses between two samples to count as working


def work_sign(pid: int) -> tuple[int, str] | None:
    """(CPU clock ticks used, user and system, all threads; scheduling state) of process
    `pid`, from /proc; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12]), fields[0].decode()
    except (OSError, IndexError, ValueError):
        return None


class WorkWatch:
    """When the engine's workers last showed a sign of work (`active_at`): CPU time used
    since the previous sample (at least `ACTIVE_CPU_S`), or a running ("R") or disk-wait
    ("D") state. Watches only when every worker runs on this host (`watch`), and stops for
    good if a worker's /proc cannot be read: `pids` empty means no evidence. `cpu`: every
    worker runs its model on the CPU, so that no sign of work means no work (a CUDA
    worker may wait for its GPU without using CPU time)."""

    def __init__(self, read: Callable[[int], tuple[int, str] | None] = work_sign) -> None:
        self.read = read
        self.pids: list[int] = []
        self.cpu = False
        self.active_at = 0.0
        self.stopped: dict[int, float] = {}  # pid -> since when it has been stopped ("T")
        self._ticks: dict[int, int] = {}
        tick_s = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self._active_ticks = max(1, round(ACTIVE_CPU_S / tick_s))

    def watch(self, workers: list[WorkerReady]) -> None:
        here = this_host()
        local = bool(workers) and all(w.host in ("", here) for w in workers)
        self.pids = [w.pid for w in workers] if local else []
        self.cpu = local and all(w.device == "cpu" for w in workers)
        self.stopped.clear()

    def sample(self, now: float) -> None:
        for pid in self.pids:
            sign = self.read(pid)
            if sign is None:  # no evidence from now on, stale or new
                self.pids, self.cpu = [], False
                self.stopped.clear()
                return
            ticks, state = sign
            if state == "T":
                self.stopped.setdefault(pid, now)
            else:
                self.stopped.pop(pid, None)
            last = self._ticks.get(pid)
            if state in ("R", "D") or last is None or ticks - last >= self._active_ticks:
                self.active_at = now
            self._ticks[pid] = ticks

    def stopped_for(self, now: float) -> tuple[int, float] | None:
        """(pid, seconds) of the worker stopped longest (by a signal: state "T"), if any."""
        if not self.stopped:
            return None
        pid, since = min(self.stopped.items(), key=lambda kv: kv[1])
        return pid, now - since

    def working(self, now: float) -> bool:
        """A sign of work at one of the last two samples."""
        return bool(self.pids) and now - self.active_at <= 2 * PEER_CHECK_S
