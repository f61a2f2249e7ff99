"""Process titles: what `ps` shows of each process, naming its kind, engine, role and rank
(`subway worker engine=1 role=both rank=0`), so that an operator can tell them apart."""

from __future__ import annotations

from subway.ipc.config import EngineConfig

KINDS = ("frontend", "scheduler", "worker")


def title(kind: str, config: EngineConfig, rank: int | None = None) -> str:
    if kind == "frontend":
        n = config.parallel.data_parallel_size
        return f"subway frontend engines={n} port={config.server.port}"
    p = config.parallel
    words = [f"subway {kind}", f"engine={p.data_parallel_rank}", f"role={p.role}"]
    if rank is not None:
        words.append(f"rank={rank}")
    return " ".join(words)


def set_title(kind: str, config: EngineConfig, rank: int | None = None) -> None:
    import setproctitle

    setproctitle.setproctitle(title(kind, config, rank))


def parse(cmdline: list[str]) -> dict[str, str]:
    """A Subway process's kind (and engine, role, rank where it has them) from its command
    line: its title, or, before it set one, `python -m subway.tools.cli KIND ...`. Empty
    for any other process."""
    words = cmdline[0].split() if len(cmdline) >= 1 and cmdline[0].startswith("subway ") else []
    if len(words) >= 2 and words[1] in KINDS:
        out = {"kind": words[1]}
        out.update(w.split("=", 1) for w in words[2:] if "=" in w)
        return out
    if len(cmdline) > 3 and cmdline[3] in KINDS:
        out = {"kind": cmdline[3]}
        if "--rank" in cmdline[4:]:
            out["rank"] = cmdline[cmdline.index("--rank") + 1]
        return out
    return {}
