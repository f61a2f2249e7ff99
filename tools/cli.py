"""The `subway` command: `serve` starts everything on one host; `frontend`, `scheduler` and
`worker` start one process each, for deployments spread over hosts."""

from __future__ import annotations

import argparse
import sys

from subway.ipc.config import EngineConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority", "sjf", "edf", "static")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig(run_id="x")
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", default="", help="Hugging Face folder (default: SmolLM2-135M-Instruct)"
    )
    g.add_argument("--served-model-name", default="")
    g.add_argument("--tokenizer", default="")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    g.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("scheduling and memory")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory, help="bytes (CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--num-kv-blocks", type=int, default=0, help="override the KV block count")
    g.add_argument("--policy", default=d.policy, choices=POLICIES)
    g.add_argument("--static-batch-window-ms", type=float, default=0.0,
                   help="--policy static: wait this long for a batch to fill")  # fmt: skip
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-overlap", action="store_true", help="plan each step after the last")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--threads", type=int, default=0, help="torch threads per worker")
    g = p.add_argument_group("serving")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--api-key", default="")
    g.add_argument("--max-waiting", type=int, default=0)
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout)
    g.add_argument("--request-timeout", type=float, default=0.0, help="seconds; 0: no limit")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g = p.add_argument_group("process addresses (several hosts)")
    g.add_argument("--run-id", default="", help="names this engine's sockets and shm buffers")
    g.add_argument("--run-dir", default="")
    g.add_argument("--scheduler-addr", default="")
    g.add_argument("--frontend-addr", default="")
    g.add_argument("--plan-addr", default="")
    g.add_argument("--result-addr", default="")
    g.add_argument("--client-addr", default="", help='native ZMQ client endpoint; "off": none')
    g.add_argument("--dist-init-addr", default="127.0.0.1:29533")
    g.add_argument("--no-shm", action="store_true", help="send token ids inline (several hosts)")
    p.add_argument("--config-json", default="", help=argparse.SUPPRESS)


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    if a.config_json:
        return EngineConfig.from_json(a.config_json)
    extra = {"run_id": a.run_id} if a.run_id else {}
    return EngineConfig(
        model=a.model,
        served_model_name=a.served_model_name,
        tokenizer=a.tokenizer,
        dtype=a.dtype,
        device=a.device,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        block_size=a.block_size,
        kv_cache_memory=a.kv_cache_memory,
        gpu_memory_utilization=a.gpu_memory_utilization,
        num_kv_blocks=a.num_kv_blocks,
        seed=a.seed,
        tensor_parallel_size=a.tensor_parallel_size,
        policy=a.policy,
        static_batch_window_ms=a.static_batch_window_ms,
        enable_prefix_caching=not a.no_prefix_caching,
        overlap=not a.no_overlap,
        host=a.host,
        port=a.port,
        api_key=a.api_key,
        max_waiting=a.max_waiting,
        threads=a.threads,
        shutdown_timeout=a.shutdown_timeout,
        request_timeout=a.request_timeout,
        enforce_eager=a.enforce_eager,
        client_addr=a.client_addr,
        run_dir=a.run_dir,
        scheduler_addr=a.scheduler_addr,
        frontend_addr=a.frontend_addr,
        plan_addr=a.plan_addr,
        result_addr=a.result_addr,
        dist_init_addr=a.dist_init_addr,
        use_shm=not a.no_shm,
        **extra,
    )


def resolve_model(config: EngineConfig) -> EngineConfig:
    """Fill in the default model (converting it on first use) and the served name."""
    if config.model:
        return config
    from subway.worker.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    path = ensure_default_model()
    return config.replace(
        model=path, served_model_name=config.served_model_name or DEFAULT_MODEL_NAME
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="subway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start frontend, scheduler and workers on this host")
    add_engine_args(serve)
    serve.add_argument("--demo", action="store_true", help="answer one demo request when ready")
    for name in ("frontend", "scheduler", "worker"):
        p = sub.add_parser(name, help=f"start one {name} process")
        add_engine_args(p)
        if name == "worker":
            p.add_argument("--rank", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command != "serve" and not args.run_id:
        args.run_id = "default"  # processes started one by one must agree on names
    config = config_from_args(args)
    if args.command != "serve":
        from subway.tools.launch import die_with_parent

        die_with_parent()

    if args.command == "serve":
        from subway.tools.launch import serve

        return serve(resolve_model(config), demo=args.demo)
    if args.command == "frontend":
        from subway.frontend.server import run_frontend

        return run_frontend(resolve_model(config))
    if args.command == "scheduler":
        from subway.scheduler.process import run_scheduler

        return run_scheduler(config)
    from subway.worker.process import run_worker

    return run_worker(resolve_model(config), args.rank)


if __name__ == "__main__":
    sys.exit(main())
