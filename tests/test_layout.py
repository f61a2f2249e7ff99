"""The layout's rules, read from the source: who may import what, and how long a module grows."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Folder -> the packages its modules may not import (at the top or inside a function).
FORBIDDEN = {
    "scheduler": ("torch", "subway.worker", "subway.kernels", "subway.frontend", "subway.tools"),
    "ipc": ("subway.scheduler", "subway.worker", "subway.kernels", "subway.frontend",
            "subway.tools", "subway.client"),
    "frontend": ("torch", "subway.scheduler", "subway.worker", "subway.kernels", "subway.tools"),
    "client": ("torch", "subway.frontend", "subway.scheduler", "subway.worker",
               "subway.kernels", "subway.tools", "subway.ipc"),
    "subway_kernels": ("subway.worker", "subway.scheduler", "subway.frontend", "subway.tools"),
}  # fmt: skip
MAX_LINES = 450
MAX_FUNCTION_LINES = 80  # a longer body is several jobs: name them
# Benchmarks and device checks are not product modules.
NOT_PRODUCT = ("tools/bench/", "tools/gpu_check.py")


def _modules(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_respect_the_process_boundaries(folder):
    assert _modules(folder), folder
    bad = []
    for path in _modules(folder):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_product_modules_stay_short():
    long = []
    for folder in ("scheduler", "ipc", "frontend", "client", "worker", "subway_kernels", "tools",
                   "subway_pkg"):  # fmt: skip
        for path in _modules(folder):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(NOT_PRODUCT):
                continue
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long.append(f"{rel}: {n} lines")
    assert not long, long


def _product_modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for folder in ("scheduler", "ipc", "frontend", "client", "worker", "subway_kernels", "tools",
                   "subway_pkg"):  # fmt: skip
        for path in _modules(folder):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(NOT_PRODUCT):
                out.append((rel, path))
    return out


def _long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function or method longer than `limit`, from `def` to its
    last line (decorators not counted)."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_product_functions_stay_short():
    """Files split by job, not by length: no function or method over MAX_FUNCTION_LINES."""
    long = [
        f"{rel}: {name} has {n} lines"
        for rel, path in _product_modules()
        for name, n in _long_functions(path.read_text())
    ]
    assert not long, long


def test_a_long_function_is_seen():
    """The rule counts a method from its `def` to its last line (so it can fail)."""
    n = MAX_FUNCTION_LINES
    body = "".join(f"        x{i} = {i}\n" for i in range(n))  # def + n lines: one too many
    assert _long_functions("class A:\n    def f(self):\n" + body) == [("f", n + 1)]
    assert _long_functions("def g():\n" + body[: -len(f"        x{n - 1} = {n - 1}\n")]) == []


def _scheduler_import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in _modules("scheduler"):
        names = _imports(path)
        graph[path.stem] = {
            n.split(".")[2]
            for n in names
            if n.startswith("subway.scheduler.") and n.count(".") >= 2
        } - {path.stem}
    return graph


def test_the_scheduler_modules_import_in_one_direction():
    """No circle among the scheduler's modules, not even under TYPE_CHECKING: the planner,
    the settling and the policies get what they need as arguments, and the `Scheduler`
    that owns the queues imports them (never the other way)."""
    import graphlib

    graph = _scheduler_import_graph()
    assert {"scheduler", "planner", "settle", "policy", "handoff"} <= set(graph)
    assert "planner" in graph["scheduler"] and "scheduler" in graph["handoff"]
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a circle


def test_a_forbidden_import_is_seen(tmp_path):
    """The scan finds an import hidden inside a function (so the rules above can fail)."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    import torch.nn\n    from subway.worker import runner\n")
    assert {"torch.nn", "subway.worker", "subway.worker.runner"} <= _imports(p)


def test_every_non_python_file_a_package_reads_ships_with_it():
    """A wheel carries a package's other files only where package-data names them: the
    kernels' sources and headers, the AMX probe, the lm-eval task files."""
    import fnmatch
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs, data = config["package-dir"], config["package-data"]
    missing = []
    for folder in set(dirs.values()):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            # The file belongs to the deepest package whose folder holds it.
            package, home = max(
                ((p, f) for p, f in dirs.items() if path.is_relative_to(ROOT / f)),
                key=lambda pf: len(pf[1]),
            )
            rel = path.relative_to(ROOT / home).as_posix()
            if not any(fnmatch.fnmatch(rel, pattern) for pattern in data.get(package, [])):
                missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, sorted(set(missing))


def test_no_folder_shadows_an_installed_package():
    """Python run from the checkout (`python -m ...`, `python -c`) puts the checkout first on
    sys.path, so a folder named like an installed package hides it: a folder `kernels/` made
    transformers 5.25 import ours instead of Hugging Face's `kernels`, and fail."""
    import importlib.metadata
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {f.split("/")[0] for f in config["package-dir"].values()}
    installed = importlib.metadata.packages_distributions()
    shadowed = {f: installed[f] for f in folders if f in installed}
    assert not shadowed, shadowed
    assert "kernels" in installed or "numpy" in installed  # the lookup sees installed packages


def test_no_product_module_imports_anothers_private_names():
    """`from subway.x import _name` couples a module to another's internals: a name used
    across modules is public (tools/bench and the device checks are not product code)."""
    private = []
    for folder in ("scheduler", "ipc", "frontend", "client", "worker", "subway_kernels",
                   "tools", "subway_pkg"):  # fmt: skip
        for path in _modules(folder):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(NOT_PRODUCT):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("subway"):
                    private += [f"{rel}:{node.lineno} {node.module}.{a.name}"
                                for a in node.names
                                if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    assert not private, private


def test_a_module_that_uses_the_serving_harness_is_marked_live(request):
    """The `live` tier (tests/conftest.py) is every module that starts `subway serve`."""
    import test_metrics

    import conftest

    assert conftest._uses_the_serving_harness(test_metrics)
    assert not conftest._uses_the_serving_harness(sys.modules[__name__])
    assert request.node.get_closest_marker("live") is None
