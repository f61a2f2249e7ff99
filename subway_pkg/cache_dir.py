"""Where Subway keeps what it builds once per machine: the default model's folder, the
compiled C++ kernels (`ext/`). Its own module so that the kernels and the worker both read
it without one importing the other."""

from __future__ import annotations

import hashlib
import os
import sys


def cache_root() -> str:
    """$SUBWAY_CACHE, else $XDG_CACHE_HOME/subway, else ~/.cache/subway."""
    return os.environ.get("SUBWAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "subway"
    )


def kernel_build_dir(csrc: str) -> str:
    """Where the C++ kernels from the sources in `csrc` are built for this Python
    environment: `ext/<key>` of the cache, one per (environment, sources' folder). torch
    rebuilds an extension when its include paths or source paths change, so two
    environments (a venv and the system's) or two checkouts sharing one folder rebuilt
    each other's kernels, about 100 s, at every switch."""
    where = f"{sys.prefix}\0{os.path.realpath(csrc)}"
    key = hashlib.sha256(where.encode()).hexdigest()[:12]
    return os.path.join(cache_root(), "ext", key)
