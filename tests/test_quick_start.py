"""The README's quick start as a new user meets it: a fresh clone, an empty home folder and a
stock distribution Python, one that is externally managed (PEP 668: its pip refuses to
install outside a virtual environment, as Debian 12's and Ubuntu 23.04's do) and has no pip
of its own. Both commands run as the README prints them; `make serve`'s time to its demo
answer and the longest silence in its output are printed (README, Quick start)."""

from __future__ import annotations

import os
import pathlib
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The one-line code blocks of README's Quick start, in order."""
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```\n(.*?)\n```", quick, re.S) if "\n" not in b.strip()]


def stock_python(folder: pathlib.Path) -> pathlib.Path:
    """A Python at `folder` that is not a virtual environment, whose standard library holds
    an EXTERNALLY-MANAGED marker and whose site-packages is empty: this interpreter's binary,
    its standard library linked in file by file."""
    base = pathlib.Path(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = pathlib.Path(sysconfig.get_path("stdlib", vars={"installed_base": str(base)}))
    lib = folder / "lib" / version
    (lib / "site-packages").mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name != "site-packages":
            (lib / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text(
        "[externally-managed]\nError=This Python is the system's (a stand-in for Debian 12's).\n"
    )
    include = pathlib.Path(sysconfig.get_path("include"))  # python3-dev's headers: the
    (folder / "include").mkdir()  # kernels' build needs them, as Debian's python3-dev gives
    (folder / "include" / include.name).symlink_to(include)
    (folder / "bin").mkdir()
    real = pathlib.Path(os.path.realpath(base / "bin" / version))
    shutil.copy2(real, folder / "bin" / "python3")
    return folder / "bin" / "python3"


class Output:
    """A command's merged output, read line by line as it comes, each line with its time."""

    def __init__(self, cmd: str, env: dict, cwd: pathlib.Path) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.t0 = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self._buf = b""

    def until(self, done: str | None, within: float) -> float:
        """Seconds since the start when a line containing `done` came (None: until the
        output ends). Fails with the output's tail if it ends first or `within` passes."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.killpg(self.proc.pid, signal.SIGKILL)
                pytest.fail(f"{self.cmd}: no {done!r} within {within} s:\n" + self.tail())
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                self.proc.wait()
                if done is None:
                    return time.monotonic() - self.t0
                pytest.fail(f"{self.cmd} ended ({self.proc.returncode}) before {done!r}:\n"
                            + self.tail())  # fmt: skip
            self._buf += chunk
            *complete, self._buf = re.split(rb"[\r\n]", self._buf)
            for raw in complete:
                line = raw.decode(errors="replace")
                self.lines.append((time.monotonic() - self.t0, line))
                if done is not None and done in line:
                    return self.lines[-1][0]

    def tail(self) -> str:
        return "\n".join(f"{t:7.1f} {line}" for t, line in self.lines[-40:])

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _longest_silence(lines: list[tuple[float, str]]) -> tuple[float, str]:
    gaps = [(b[0] - a[0], a[1]) for a, b in zip(lines, lines[1:], strict=False)]
    return max(gaps, default=(0.0, ""))


@pytest.mark.slow
def test_the_readme_commands_work_on_an_externally_managed_python(tmp_path):
    assert readme_commands() == ["make serve", "make test"]
    python = stock_python(tmp_path / "system")
    refused = subprocess.run(
        [python, "-m", "ensurepip"], capture_output=True, text=True, timeout=120
    )  # pip of its own would go outside a virtual environment: refused
    assert refused.returncode != 0 and "externally-managed" in refused.stdout + refused.stderr
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SUBWAY_", "PYTEST_", "VIRTUAL_ENV", "PYTHON", "XDG_", "OMP_"))
    }
    env.update(HOME=str(home), PATH=f"{python.parent}:{env['PATH']}")

    serve, demo = readme_commands()
    out = Output(serve, env, clone)
    took = out.until("subway: demo<", within=1500)
    silence, before = _longest_silence(out.lines)
    os.killpg(out.proc.pid, signal.SIGINT)  # Ctrl-C, as the README says
    out.until(None, within=60)
    (tmp_path / "make-serve.log").write_text(out.text())
    print(f"\n`make serve` on a fresh clone: demo answer after {took:.0f} s; longest silence "
          f"{silence:.0f} s (after: {before!r}); log {tmp_path / 'make-serve.log'}")  # fmt: skip
    assert "subway: stopped (exit 0)" in out.text(), out.tail()
    assert "CPU kernels unavailable" not in out.text() and "make: WARNING" not in out.text()
    assert list((home / ".cache" / "subway" / "ext").glob("*/subway_cpu_kernels.so"))
    assert silence <= 10.5, f"{silence:.0f} s without a line, after {before!r}"
    assert (clone / ".venv" / "bin" / "subway").exists()
    assert not any((python.parent.parent / "lib").glob("*/site-packages/*"))  # all in .venv

    # `make test` as printed; PYTEST_ADDOPTS names one module, so that the nested run checks
    # the command and its environment rather than running the whole tier again.
    env["PYTEST_ADDOPTS"] = "tests/test_layout.py"
    done = subprocess.run(demo, shell=True, cwd=clone, env=env, capture_output=True, text=True,
                          timeout=1500)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\d+ passed", done.stdout), done.stdout[-3000:]
