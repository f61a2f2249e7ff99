"""What one core's AVX-512 FMA and AMX instructions cost here, single-threaded.

    python -m subway.tools.bench.bench_amx [--rounds 3]

Builds `amx_probe.c` with the system's C compiler (`-O2 -march=native`) into a
temporary folder and runs it `--rounds` times, printing each figure's median: FMAs a
second over 12 independent chains; ns per tile product (TDPBF16PS, TDPBSSD) on tiles
already loaded, four independent accumulators; and ns per tile when each product's A
tile is loaded first from a buffer of 32 KB, 1 MB or 64 MB. A virtual machine may
run these several times slower than the same CPU bare (docs/BENCHMARKS.md); the AMX
kernels' cut-over row counts follow from these figures, so compare them before
carrying a kernel figure from one machine to another.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile

SOURCE = os.path.join(os.path.dirname(__file__), "amx_probe.c")


def build(directory: str) -> str:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bench_amx: no C compiler here")
    exe = os.path.join(directory, "amx_probe")
    subprocess.run([cc, "-O2", "-march=native", SOURCE, "-o", exe], check=True)
    return exe


def probe(exe: str) -> dict[str, tuple[float | None, str]]:
    """One run: name -> (value, unit); value None where the CPU or the kernel lacks it."""
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    figures: dict[str, tuple[float | None, str]] = {}
    for line in out.splitlines():
        name, value, unit = (line.split() + ["", ""])[:3]
        try:
            figures[name] = (float(value), unit)
        except ValueError:
            figures[name] = (None, value)
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        runs = [probe(exe) for _ in range(max(1, a.rounds))]
    print(f"| instruction | median of {len(runs)} | unit |")
    print("|---|---:|---|")
    for name, (_, unit) in runs[0].items():
        values = [r[name][0] for r in runs if r.get(name, (None, ""))[0] is not None]
        shown = f"{statistics.median(values):.2f}" if values else "-"
        print(f"| {name} | {shown} | {unit if values else runs[0][name][1]} |")


if __name__ == "__main__":
    main()
