"""Where one decode step's time goes, on the CPU, with the real ModelRunner.

    python -m subway.tools.bench.profile_step [--dtype bfloat16] [--batch 64] [--context 256]

Prefills `--batch` sequences of `--context` tokens, then times decode steps of
the whole batch and splits one step's time by function (cProfile: it sees the
compiled attention kernel, which torch's profiler does not). Prints the step
time, tokens/s at that batch, and the shares: linear layers (the matmuls),
attention, sampling, and everything else.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from subway.ipc.config import EngineConfig
from subway.ipc.messages import NewSeq, Plan, SamplingParams, SeqStep, TokenRef
from subway.worker.runner import ModelRunner

GROUPS = {
    "linear (matmuls)": ("linear", "qlinear_pointwise", "amx_int8_matmul", "avx2_int8_matmul"),
    "int8 activations (quantize, rescale)": ("quantize_rows", "rescale_rows_"),
    "attention": ("paged_decode", "scaled_dot_product_attention", "paged_attention"),
    "sampling": ("argmax", "sampler", "softmax", "log_softmax", "topk"),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quantization", default="none", choices=("none", "int8"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    p.add_argument("--bf16-matmul", default="auto", choices=("auto", "native", "float32"))
    p.add_argument("--model", default="", help="an HF folder (default: the default model)")
    p.add_argument("--top", type=int, default=0, help="also list the N functions taking most time")
    a = p.parse_args(argv)
    from subway.worker.default_model import ensure_default_model

    torch.set_num_threads(a.threads)
    B, C, bs = a.batch, a.context, 16
    per_seq = C // bs + 2
    cfg = EngineConfig.build(
        path=a.model or ensure_default_model(),
        dtype=a.dtype,
        num_kv_blocks=B * per_seq,
        quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype,
        bf16_matmul=a.bf16_matmul,
    )
    runner = ModelRunner(cfg)
    greedy = SamplingParams(temperature=0.0)
    for i in range(B):
        prompt = TokenRef(ids=[(i * 7 + j) % 30000 + 100 for j in range(C)])
        blocks = list(range(i * per_seq, (i + 1) * per_seq))
        runner.execute(
            Plan(i, [SeqStep(i, 0, C, blocks, True)], new_seqs=[NewSeq(i, prompt, greedy)])
        )

    def decode(step: int) -> None:
        for s in runner.seqs.values():  # keep every context at C + 1 tokens
            del s.tokens[C + 1 :]
        runner.execute(Plan(step, [SeqStep(i, C, 1, [], True) for i in range(B)]))

    decode(10_000)
    times = []
    for k in range(a.steps):
        t = time.perf_counter()
        decode(10_001 + k)
        times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]

    prof = cProfile.Profile()
    prof.enable()
    decode(20_000)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values())
    shares = dict.fromkeys(GROUPS, 0.0)
    for (_, _, name), (_, _, tt, _, _) in stats.items():
        for group, keys in GROUPS.items():
            if any(k in name for k in keys):
                shares[group] += tt
                break
    shares["other (Python, norms, rope, input prep)"] = total - sum(shares.values())
    print(
        f"{a.dtype} ({a.quantization} weights, {a.kv_cache_dtype} KV) decode, batch {B}, context {C + 1}, {a.threads} threads:"
    )
    print(f"  step {1e3 * step:.1f} ms (median of {a.steps}) -> {B / step:.0f} tokens/s")
    print("| part | ms per step | share |")
    print("|---|---|---|")
    for group, t in shares.items():
        print(f"| {group} | {1e3 * t:.1f} | {t / total:.0%} |")
    if a.top:
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
