"""The `subway` command: `serve` starts everything on one host; `frontend`, `scheduler` and
`worker` start one process each, for deployments spread over hosts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
import sys

from subway.ipc.config import EngineConfig, field_owners
from subway.ipc.config import parts as config_parts

GROUP_TITLES = {
    "model": "model",
    "cache": "KV cache",
    "scheduler": "scheduling",
    "parallel": "parallelism",
    "server": "serving",
    "lora": "LoRA adapters",
    "ipc": "process addresses (several hosts)",
}


def engine_flags() -> list[tuple[str, list[str], dict]]:
    """(group title, names, argparse keywords) of every engine flag, one per config field,
    generated from the fields: name, default, type, help. `add_engine_args` and the
    README's table (`tools/flags_doc.py`) both read this."""
    out = []
    for part, cls in config_parts():
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flag = meta.get("flag") or "--" + f.name.replace("_", "-")
            names = [flag, meta["alias"]] if "alias" in meta else [flag]
            kw: dict = {"dest": f.name, "default": f.default, "help": meta.get("help") or None}
            if f.type == "bool":
                # A switch turns a default around: --no-overlap for True, --enforce-eager for False.
                kw["action"] = "store_false" if f.default else "store_true"
            elif "nargs" in meta:
                kw["nargs"], kw["type"] = meta["nargs"], str
            else:
                kw["type"] = _TYPES[f.type]
                if "choices" in meta:
                    kw["choices"] = meta["choices"]
            out.append((GROUP_TITLES[part], names, kw))
    return out


def add_engine_args(p: argparse.ArgumentParser) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for title, names, kw in engine_flags():
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        kw = dict(kw)
        if "action" not in kw and kw["help"] is not None and kw["default"] not in ("", None, ()):
            kw["help"] += f" (default: {kw['default']})"
        groups[title].add_argument(*names, **kw)
    p.add_argument("--config-json", default="", help=argparse.SUPPRESS)


_TYPES = {"int": int, "float": float, "str": str}  # the fields' annotations, as strings


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    if a.config_json:
        return EngineConfig.from_json_arg(a.config_json)
    try:  # a value its part refuses (--lora-modules NAME, --kv-addr ...): a message
        config = EngineConfig.build(**{name: getattr(a, name) for name in field_owners()})
    except ValueError as e:
        raise SystemExit(f"subway: {e}") from None
    return resolve_secrets(config)


def resolve_secrets(config: EngineConfig) -> EngineConfig:
    """The API key from `--api-key-file` (refused unless only its owner can read it) or,
    failing `--api-key`, from `SUBWAY_API_KEY`."""
    server = config.server
    if server.api_key_file:
        mode = os.stat(server.api_key_file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SystemExit(
                f"subway: {server.api_key_file} is readable by others (mode {mode & 0o777:o}); "
                "chmod 600 it"
            )
        with open(server.api_key_file) as f:
            return config.replace(api_key=f.read().strip())
    if not server.api_key and os.environ.get("SUBWAY_API_KEY"):
        return config.replace(api_key=os.environ["SUBWAY_API_KEY"])
    return config


def keygen(path: str) -> int:
    """`subway keygen FILE`: one engine's key pair; copy it (mode 0600) to every host and
    start each process with --curve-key-file FILE."""
    from subway.ipc.curve import write_key_file, write_public_file

    try:
        keys = write_key_file(path)
        write_public_file(path + ".pub", keys.public)  # for native ZMQ clients over tcp://
    except OSError as e:
        raise SystemExit(f"subway: cannot write {path}: {e}") from None
    print(f"subway: wrote a CurveZMQ key pair to {path} (public key {keys.public.decode()}) "
          f"and its public key alone to {path}.pub")  # fmt: skip
    return 0


def check_curve_keys(config: EngineConfig) -> None:
    """A process started alone with tcp:// internal addresses: its key file, checked before
    anything starts, so that a missing or open one is a message, not a traceback."""
    from subway.ipc.curve import require_key_file

    try:
        require_key_file(config.ipc)
    except (OSError, ValueError) as e:
        raise SystemExit(f"subway: {e}") from None


def check_speculative(config: EngineConfig) -> None:
    """`--speculative-config`, checked before anything starts: a bad one is a message."""
    from subway.scheduler.speculative import SpeculativeConfig, SpeculativeConfigError

    try:
        SpeculativeConfig.parse(config.scheduler.speculative_config)
    except SpeculativeConfigError as e:
        raise SystemExit(f"subway: {e}") from None


def check_lora(config: EngineConfig, read_adapters: bool = True) -> None:
    """`--enable-lora`, checked before anything starts: refused with disaggregation; and
    (`read_adapters`) each `--lora-modules` folder, read and checked against the model's
    config.json as the frontend checks it, so that a bad adapter is a one-line message
    before any worker loads one. The model's path must be resolved (`resolve_model`)."""
    lora, p = config.lora, config.parallel
    if not lora.enable_lora:
        return
    if p.prefill_engines > 0 or p.decode_engines > 0:
        raise SystemExit(
            "subway: LoRA with disaggregation is not supported yet (--enable-lora or "
            "--lora-modules, with --prefill-engines and --decode-engines)"
        )
    if not read_adapters:
        return
    from subway.frontend.lora import LoraError, LoraRegistry

    try:
        LoraRegistry(config)
    except LoraError as e:
        raise SystemExit(f"subway: {e}") from None


def check_policy(config: EngineConfig) -> None:
    """`--policy` and its options, checked before anything starts."""
    from subway.scheduler.policy import make_policy, policy_options

    try:
        make_policy(config.scheduler.policy, **policy_options(config))
    except ValueError as e:
        raise SystemExit(f"subway: --policy {config.scheduler.policy}: {e}") from None


def check_quantization(config: EngineConfig) -> None:
    """`--quantization` and `--kv-cache-dtype`, checked before anything starts: by `serve`
    and by each worker, the processes that import torch anyway (the check needs it). Without
    either flag there is nothing to check, and torch is not imported for it."""
    if not config.quantized:
        return
    from subway.worker.quant import unsupported_reason

    reason = unsupported_reason(config)
    if reason is not None:
        raise SystemExit(f"subway: {reason}")


def one_engine(config: EngineConfig) -> EngineConfig:
    """A scheduler or worker started by hand: the config of its engine
    (`--data-parallel-rank` of `--data-parallel-size`), derived as the frontend derives it."""
    try:
        return config.engine(config.parallel.data_parallel_rank)
    except ValueError as e:
        raise SystemExit(f"subway: {e} (give --data-parallel-size too)") from None


def resolve_model(config: EngineConfig) -> EngineConfig:
    """Fill in the default model (converting it on first use) and the served name; a GGUF
    file's folder (`worker/gguf_file.py`)."""
    path = config.model.path
    if path and path.lower().endswith(".gguf"):
        from subway.worker.gguf_file import gguf_folder

        name, served = os.path.basename(path), config.model.served_model_name
        return config.replace(  # served as the file's name without .gguf, unless named
            path=gguf_folder(path, config.model.dtype),
            served_model_name=name[: -len(".gguf")] if served in ("", name) else served,
        )
    if path:
        return config
    from subway.worker.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    path = ensure_default_model()
    return config.replace(
        path=path, served_model_name=config.model.served_model_name or DEFAULT_MODEL_NAME
    )


def resolve_or_usage(parser: argparse.ArgumentParser, config: EngineConfig) -> EngineConfig:
    """`resolve_model`, a GGUF file that cannot be served as asked a usage error."""
    from subway.worker.gguf_file import GGUFError

    try:
        return resolve_model(config)
    except GGUFError as e:
        parser.error(str(e))


def bench_main(what: str, argv: list[str]) -> int:
    """`subway bench serve` (tools/bench/bench_serving.py) or `compare` (url_compare.py)."""
    if what == "serve":
        from subway.tools.bench.bench_serving import main as run
    else:
        from subway.tools.bench.url_compare import main as run
    run(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="subway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start frontend, scheduler and workers on this host")
    add_engine_args(serve)
    serve.add_argument("--demo", action="store_true", help="answer one demo request when ready")
    kg = sub.add_parser("keygen", help="write a new CurveZMQ key file (mode 0600) for "
                            "processes started one by one over tcp://")  # fmt: skip
    kg.add_argument("file", help="where to write it (never over an existing file)")
    env = sub.add_parser("env", help="what a bug report needs: versions, CPU, kernel paths")
    env.add_argument("--json", action="store_true", help="print the data as JSON")
    bench = sub.add_parser("bench", help="serve: load a running server (any OpenAI-compatible "
                           "URL); compare: two servers, alternately")  # fmt: skip
    bench.add_argument("what", choices=("serve", "compare"))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="its flags (--help lists them)")
    for name in ("frontend", "scheduler", "worker"):
        p = sub.add_parser(name, help=f"start one {name} process")
        add_engine_args(p)
        if name == "worker":
            p.add_argument("--rank", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "keygen":
        return keygen(args.file)
    if args.command == "env":
        from subway.tools.env_report import main as env_main

        return env_main(["--json"] if args.json else [])
    if args.command == "bench":
        return bench_main(args.what, args.args)
    if args.command != "serve" and not args.run_id and not args.config_json:
        # One engine's processes must agree on names; a shared default would let two
        # engines on one host meet each other's sockets and buffers.
        parser.error(f"{args.command}: give every process of one engine the same --run-id")
    config = config_from_args(args)
    p = config.parallel
    if (p.prefill_engines > 0) != (p.decode_engines > 0):
        parser.error("--prefill-engines and --decode-engines go together (at least 1 each)")
    if args.command in ("scheduler", "worker") and not args.config_json:
        config = one_engine(config)
    check_speculative(config)
    check_policy(config)
    check_lora(config, read_adapters=False)  # the adapters once the model is known, below
    if args.command in ("serve", "worker"):
        check_quantization(config)
    if args.command != "serve":
        from subway.tools.launch import die_with_parent
        from subway.tools.limits import raise_fd_limit

        die_with_parent()
        # Started by `serve`, a process has the raised limit already (and `serve` warned
        # if it is short); started alone, it raises its own, and a frontend warns.
        alone = "SUBWAY_PARENT_PID" not in os.environ
        raise_fd_limit(config if args.command == "frontend" and alone else None)
        check_curve_keys(config)

    if args.command == "serve":
        from subway.tools.launch import serve

        config = resolve_or_usage(parser, config)
        check_lora(config)
        return serve(config, demo=args.demo)
    from subway.tools.proc_title import set_title

    set_title(args.command, config, args.rank if args.command == "worker" else None)
    if args.command == "frontend":
        from subway.frontend.server import run_frontend

        config = resolve_model(config)
        check_lora(config)
        return run_frontend(config)
    if args.command == "scheduler":
        from subway.scheduler.process import run_scheduler

        return run_scheduler(config)
    from subway.worker.process import run_worker

    return run_worker(resolve_model(config), args.rank)


def console() -> None:
    """The `subway` command (and `python -m subway.tools.cli`, as `serve` starts its
    children): `main`, then out at once. Each process has cleaned up by the time `main`
    returns (sockets closed, shared memory unlinked, children stopped); what normal
    interpreter exit would add is only the teardown of torch, xgrammar and their threads,
    1-2 s per process and 6 s for a whole `serve` to stop. An exception or a usage error
    still leaves the ordinary way, with its traceback."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
