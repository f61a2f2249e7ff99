"""The open-file limit of `serve` and of each process it starts (`raise_fd_limit`)."""

from __future__ import annotations

import resource
import sys

from subway.ipc.config import EngineConfig

FD_HEADROOM = 256  # descriptors a frontend needs besides its clients' connections


def raise_fd_limit(config: EngineConfig | None = None) -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (what it starts inherits
    it); the new soft limit. With `config`, warn when even that leaves the frontend fewer
    descriptors than `--max-connections` clients and its own need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            print(f"subway: cannot raise the open-file limit from {soft}: {e}", file=sys.stderr)
    need = config.server.max_connections + FD_HEADROOM if config is not None else 0
    if soft != resource.RLIM_INFINITY and soft < need:
        print(f"subway: the open-file limit is {soft}, under --max-connections "
              f"{config.server.max_connections} + {FD_HEADROOM}: clients may use up the "
              "frontend's descriptors (raise the hard limit: ulimit -Hn)", file=sys.stderr)  # fmt: skip
    return soft
