"""Sliding windows' memory: what a long conversation holds, and how many long prompts run
at once under the same `--kv-cache-memory`, with hybrid KV groups and without.

    python -m subway.tools.bench.bench_windows memory [--model DIR] [--tokens 4096]
    python -m subway.tools.bench.bench_windows metadata [--model DIR] [--batch 64]
    python -m subway.tools.bench.bench_windows serve [--model DIR] [--prompts 8]
        [--prompt-len 4096] [--max-tokens 64] [--fit 2.2] [--rounds 2] [--dtype bfloat16]

`memory` replays a conversation (its first half prefilled in chunks of 512, the rest
decoded a token a step) on the block manager with the model's KV groups and prints the
KV it holds at the end and at most while decoding, over a full-attention cache's (layer
blocks: pages x layers a page, against blocks x all layers). `serve` runs the model in
this process (the `LLM` engine) on `--prompts` random prompts at once, with a KV budget
of `--fit` full-attention sequences, the two layouts alternated for `--rounds` rounds:
the most sequences running at once, preemptions, wall time and output tokens per second.
`metadata` times a decode step's attention metadata (`KVPages.metadata`) at `--batch`
decodes of 1,000 tokens, one group and the model's groups alternated.
The default model is the real Gemma 3 270M (15 of its 18 layers slide over 512 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from subway.ipc.kv_groups import plan_groups
from subway.scheduler.block_manager import BlockManager
from subway.worker.default_model import ensure_gemma3_270m


def layer_windows(path: str) -> tuple[list[int], int]:
    """Each layer's window as the CPU runner slides it, and the model's positions."""
    from subway.kernels.dispatch import choose_kernels
    from subway.worker.model import layer_windows as windows_of
    from subway.worker.model_arch import load_model_arch

    arch = load_model_arch(path)
    kernels = choose_kernels("auto", True, __import__("torch").device("cpu"))
    return windows_of(arch, kernels), arch.max_position_embeddings


def replay(
    windows: tuple[int, ...], tokens: int, chunk: int, block_size: int
) -> tuple[BlockManager, int]:
    """A conversation of `tokens` on a block manager with these KV groups: its first half
    prefilled in chunks of `chunk`, the rest decoded a token a step. The block manager at
    its end, and the most pages it held while decoding."""
    bm = BlockManager(1 << 20, block_size, windows=windows)
    prompt = tokens // 2
    for _ in range(0, prompt, chunk):
        bm.allocate(1, chunk)
    peak = 0
    for _ in range(prompt, tokens):
        bm.allocate(1, 1)
        peak = max(peak, bm.num_used_blocks)
    return bm, peak


def memory(path: str, tokens: int, block_size: int, chunk: int) -> None:
    windows, positions = layer_windows(path)
    groups = plan_groups(windows, positions)
    bm, peak = replay(groups.windows, tokens, chunk, block_size)
    full = -(-tokens // block_size) * len(windows)
    end = bm.num_used_blocks * groups.page_layers
    print(f"model {path}: {len(windows)} layers, {sum(map(bool, windows))} sliding "
          f"(windows {sorted(set(windows) - {0})}); groups {groups.windows}, "
          f"{groups.page_layers} layers a page")  # fmt: skip
    print(
        f"{tokens}-token conversation, blocks of {block_size}: holds {end} layer blocks at "
        f"its end ({end / full:.1%} of a full cache's {full}), at most "
        f"{peak * groups.page_layers} while decoding ({peak * groups.page_layers / full:.1%})"
    )


def metadata(path: str, batch: int, rounds: int = 5) -> None:
    import numpy as np
    import torch

    from subway.ipc.kv_groups import single_group
    from subway.kernels.attention import positions_and_slots
    from subway.worker.kv_pages import KVPages

    windows, positions = layer_windows(path)
    layouts = {"one group": single_group(len(windows)), "hybrid": plan_groups(windows, positions)}
    qlens, ctx, nb = np.ones(batch, dtype=np.int64), np.full(batch, 1000), 1000 // 16 + 1
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(rounds):
        for name, groups in layouts.items():
            pages, G = KVPages(groups, windows), groups.num_groups
            tables = np.arange(batch * nb * G, dtype=np.int32).reshape(batch, nb * G)
            slots = positions_and_slots(qlens, ctx, tables[:, ::G], 16)[1]
            t0 = time.perf_counter()
            for _ in range(200):
                pages.metadata(qlens, ctx, tables, slots, 16, torch.device("cpu"))
            times[name].append((time.perf_counter() - t0) / 200)
    for name, ts in times.items():
        print(f"{name:9s} ({layouts[name].num_groups} groups): {1e3 * statistics.median(ts):.3f} ms "
              f"a step (median of {rounds}; {1e3 * min(ts):.3f}-{1e3 * max(ts):.3f})")  # fmt: skip


def _engine(path: str, hybrid: bool, kv_bytes: int, threads: int, dtype: str):
    from subway.ipc.config import EngineConfig
    from subway.llm import LLM

    config = EngineConfig.build(
        path=path, run_id=f"bw{int(hybrid)}", threads=threads, kv_cache_memory=kv_bytes,
        hybrid_kv_cache=hybrid, enable_prefix_caching=False, max_num_seqs=64, dtype=dtype,
    )  # fmt: skip
    return LLM(config)


def _one(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from subway.ipc.messages import SamplingParams
    from subway.llm import Output

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.scheduler.engine_stats().num_preempted_total
    ids = [engine.add(p, sp) for p in prompts]
    outputs: dict[str, Output] = {}
    peak = [0]

    def on_deltas(deltas) -> None:
        for d in deltas:
            outputs.setdefault(d.request_id, Output()).add(d)
        peak[0] = max(peak[0], engine.scheduler.num_running)

    t0 = time.perf_counter()
    engine.core.run(on_deltas)
    wall = time.perf_counter() - t0
    n = sum(len(outputs[i].token_ids) for i in ids)
    return {
        "peak_running": peak[0],
        "preempted": engine.scheduler.engine_stats().num_preempted_total - before,
        "wall_s": wall,
        "output_tok_s": n / wall,
        "tokens": [outputs[i].token_ids for i in ids],
    }


def serve(args: argparse.Namespace) -> None:
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    width = 4 if args.dtype == "float32" else 2
    per_token = cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * width  # k and v
    kv_bytes = int(args.fit * (args.prompt_len + args.max_tokens) * per_token)
    rng = random.Random(0)
    vocab = cfg["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]  # fmt: skip
    engines = {h: _engine(args.model, h, kv_bytes, args.threads, args.dtype) for h in (True, False)}
    print(f"{args.prompts} prompts of {args.prompt_len} tokens, {args.max_tokens} out; KV "
          f"budget {kv_bytes / 2**20:.0f} MiB = {args.fit} full-attention sequences; "
          f"pages: hybrid {engines[True].runner.num_blocks} of "
          f"{engines[True].runner.pages.groups.page_layers} layers, full "
          f"{engines[False].runner.num_blocks} of {cfg['num_hidden_layers']}")  # fmt: skip
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        for hybrid in (True, False) if r % 2 == 0 else (False, True):
            res = _one(engines[hybrid], prompts, args.max_tokens)
            runs[hybrid].append(res)
            name = "hybrid" if hybrid else "full"
            print(f"round {r} {name:6s} peak running {res['peak_running']:2d}  preempted "
                  f"{res['preempted']:3d}  wall {res['wall_s']:6.1f} s  "
                  f"{res['output_tok_s']:6.1f} tok/s")  # fmt: skip
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs[True], runs[False], strict=True))
    ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs[True], runs[False],
                                                                    strict=True)]  # fmt: skip
    print(
        f"hybrid / full output throughput: median {statistics.median(ratios):.2f}x "
        f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}); same greedy tokens: {same}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    s = sub.add_parser("serve")
    md = sub.add_parser("metadata")
    md.add_argument("--batch", type=int, default=64)
    for q in (m, s, md):
        q.add_argument("--model", default=None, help="a Hugging Face folder (Gemma 3 270M)")
    m.add_argument("--tokens", type=int, default=4096)
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--chunk", type=int, default=512)
    s.add_argument("--prompts", type=int, default=8)
    s.add_argument("--prompt-len", type=int, default=4096)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--fit", type=float, default=2.2, help="the KV budget, in full sequences")
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args()
    args.model = args.model or ensure_gemma3_270m()
    if args.what == "memory":
        memory(args.model, args.tokens, args.block_size, args.chunk)
    elif args.what == "metadata":
        metadata(args.model, args.batch)
    else:
        serve(args)


if __name__ == "__main__":
    main()
