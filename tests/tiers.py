"""What each test tier checks: tests collected, and `assert` statements in the test
functions they run (counted once per function, not per parametrization).

    python tests/tiers.py

Tiers: unit (`-m "not slow and not live"`), live (`-m "not slow and live"`), the two of
them `make test` runs, and slow (`make test-all` adds it). See tests/conftest.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIERS = {
    "unit": "not slow and not live",
    "live": "not slow and live",
    "default (make test)": "not slow",
    "slow": "slow",
}


def collected(marks: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         "-m", marks, str(HERE)],
        capture_output=True, text=True, check=True, cwd=HERE.parent,
    ).stdout  # fmt: skip
    return [line for line in out.splitlines() if "::" in line]


def asserts_per_function() -> dict[tuple[str, str], int]:
    """(module file name, function name) -> assert statements in that function's body."""
    counts: dict[tuple[str, str], int] = {}
    for path in HERE.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = sum(isinstance(x, ast.Assert) for x in ast.walk(node))
                counts[(path.name, node.name)] = n
    return counts


def main() -> None:
    counts = asserts_per_function()
    print("| tier | tests | test functions | asserts in them |")
    print("|---|---:|---:|---:|")
    for name, marks in TIERS.items():
        ids = collected(marks)
        functions = {
            (i.split("::")[0].rsplit("/", 1)[-1], i.split("::")[-1].split("[")[0]) for i in ids
        }
        asserts = sum(counts.get(f, 0) for f in functions)
        print(f"| {name} | {len(ids)} | {len(functions)} | {asserts} |")


if __name__ == "__main__":
    main()
