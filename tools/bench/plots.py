"""Plots of a request-rate sweep (headless, Agg): one line per system.

python -m subway.tools.bench.plots docs/img/sweep.json --out-dir docs/img
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (file name, y label, how to read y from one point's metrics)
FIGURES = (
    ("throughput.png", "output tokens/s", lambda m: m["output_throughput"]),
    ("ttft_p99.png", "TTFT p99 (ms)", lambda m: m["ttft_ms"]["p99"]),
    ("itl_p99.png", "ITL p99 (ms)", lambda m: m["itl_ms"]["p99"]),
)


def x_positions(rates: list[float]) -> tuple[list[float], list[str]]:
    """An infinite rate (all at once) is drawn one step right of the largest finite rate."""
    finite = [r for r in rates if not math.isinf(r)]
    inf_x = max(finite) * 2 if finite else 1.0
    xs = [inf_x if math.isinf(r) else r for r in rates]
    labels = ["inf" if math.isinf(r) else f"{r:g}" for r in rates]
    return xs, labels


def plot_sweep(systems: dict[str, list[dict[str, Any]]], out_dir: str) -> list[str]:
    """`systems` maps a label to its points, each {"rate": float, "metrics": bench_serving metrics}."""
    os.makedirs(out_dir, exist_ok=True)
    rates = sorted({float(p["rate"]) for pts in systems.values() for p in pts})
    xs, labels = x_positions(rates)
    where = dict(zip(rates, xs, strict=True))
    paths = []
    for name, ylabel, get in FIGURES:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
        for label, pts in systems.items():
            pts = sorted(pts, key=lambda p: float(p["rate"]))
            ax.plot(
                [where[float(p["rate"])] for p in pts],
                [get(p["metrics"]) for p in pts],
                marker="o",
                label=label,
            )
        if len(xs) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, labels)
        ax.minorticks_off()
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("sweep_json", help="written by subway.tools.bench.sweep")
    p.add_argument("--out-dir", default="docs/img")
    a = p.parse_args(argv)
    with open(a.sweep_json) as f:
        data = json.load(f)
    for path in plot_sweep(data["systems"], a.out_dir):
        print(path)


if __name__ == "__main__":
    main()
