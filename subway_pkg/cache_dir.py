"""Where Subway keeps what it builds once per machine: the default model's folder, the
compiled C++ kernels (`ext/`). Its own module so that the kernels and the worker both read
it without one importing the other."""

from __future__ import annotations

import os


def cache_root() -> str:
    """$SUBWAY_CACHE, else $XDG_CACHE_HOME/subway, else ~/.cache/subway."""
    return os.environ.get("SUBWAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "subway"
    )
