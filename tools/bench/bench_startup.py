"""How long `subway serve` takes to answer /health, and which of its processes load torch.

    python -m subway.tools.bench.bench_startup [--rounds 3] [--model PATH] [-- serve flags]

Starts `subway serve` (the default model unless `--model`) `--rounds` times, one after
the other, each on a free port. It times each start from the launch to the first 200
from /health, then lists the processes that map libtorch and stops the server. Prints
each round's time and their median. To compare two versions, run it on each, one after
the other.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import httpx
import psutil

from subway.tools.serve_process import free_port


def one_start(model: str, flags: list[str], timeout: float) -> tuple[float, list[str]]:
    """Seconds to the first healthy answer, and the processes (titles) that map libtorch."""
    port = free_port()
    cmd = [sys.executable, "-m", "subway.tools.cli", "serve", "--port", str(port)]
    cmd += [
        "--dist-init-addr",
        f"127.0.0.1:{free_port()}",
        *(["--model", model] if model else []),
        *flags,
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with {proc.returncode} before it was healthy")
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"serve not healthy after {timeout:.0f} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # polling for readiness, the quantity measured
        ready = time.monotonic() - t0
        torch = []
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            try:
                if any("libtorch_cpu" in m.path for m in p.memory_maps()):
                    torch.append(" ".join(p.cmdline())[:48])
            except psutil.Error:
                continue
        return ready, torch
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="", help="a Hugging Face folder (default: the default model)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("flags", nargs="*", help="more `subway serve` flags, after --")
    a = p.parse_args(argv)
    times = []
    for r in range(max(1, a.rounds)):
        ready, torch = one_start(a.model, a.flags, a.timeout)
        times.append(ready)
        print(f"round {r + 1}: healthy after {ready:.2f} s; processes with torch: {torch}")
    print(f"median {statistics.median(times):.2f} s over {len(times)} starts")


if __name__ == "__main__":
    main()
