"""A line every few seconds while something long runs, so that no step is silent for long."""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType


class Ticker:
    """`with Ticker("building the C++ kernels into ~/.cache/subway/ext"):` prints
    "subway: still building ... (12 s)" to stderr after `first` seconds and then every
    `every` seconds until the block ends; a block that ends sooner prints nothing."""

    def __init__(self, what: str, first: float = 5.0, every: float = 10.0) -> None:
        self.what = what
        self.first = first
        self.every = every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="subway-ticker", daemon=True)
        self._t0 = 0.0

    def _run(self) -> None:
        wait = self.first
        while not self._done.wait(wait):
            elapsed = time.monotonic() - self._t0
            print(f"subway: still {self.what} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
            wait = self.every

    def __enter__(self) -> Ticker:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        self._thread.join()


def run_step(what: str, cmd: list[str]) -> int:
    """Run `cmd` (one step of `make install`), its output passed through, with a Ticker
    line every 10 s: pip's quiet installs (torch alone unpacks for tens of seconds) and the
    model's conversion say nothing of their own. Returns its exit code."""
    import subprocess

    with Ticker(what):
        return subprocess.call(cmd)


if __name__ == "__main__":  # python subway_pkg/progress.py WHAT CMD... (before subway installs)
    raise SystemExit(run_step(sys.argv[1], sys.argv[2:]))
