"""Where a whole offline run's time goes: prefill steps against decode steps by batch size.

    python -m subway.tools.bench.profile_run [--dtype bfloat16] [--num-requests 64]

The standard workload (`tools/bench/workload.py`, seed 0, all at once) through the
real Scheduler and ModelRunner in one process (`subway.llm.LLM`), no HTTP.
Every step's wall time is recorded with its token count. Prints the run's
output tokens/s, the time in steps that carry prefill chunks, and the pure
decode steps grouped by how many sequences they decode.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from subway.ipc.config import EngineConfig
from subway.ipc.messages import SamplingParams
from subway.llm import LLM
from subway.tools.bench import workload


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="folder (default: the default model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--quantization", default="none", choices=("none", "int8"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not a.model:
        from subway.worker.default_model import ensure_default_model

        a.model = ensure_default_model()
    tok = workload.load_tokenizer(a.model)
    reqs = workload.generate(tok, a.num_requests, 0)
    cfg = EngineConfig.build(
        path=a.model,
        dtype=a.dtype,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=2048,
        quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype,
    )
    eng = LLM(cfg)
    warm = workload.generate(tok, 1, seed=12345, max_output_tokens=16)[0]
    eng.generate([tok(warm.prompt)["input_ids"]], SamplingParams(max_tokens=4, temperature=0))

    steps: list[tuple[float, int, int]] = []  # (seconds, tokens, decodes)
    execute = eng.runner.execute

    def timed(plan):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = execute(plan)
        n = sum(s.num_tokens for s in plan.seqs)
        steps.append((time.perf_counter() - t, n, sum(s.num_tokens == 1 for s in plan.seqs)))
        return out

    eng.runner.execute = timed
    for r in reqs:
        eng.add(
            tok(r.prompt)["input_ids"],
            SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True),
        )
    outputs: dict = {}
    t0 = time.perf_counter()
    eng.run(outputs, overlap=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outputs.values())
    pre = [s for s in steps if s[1] > s[2]]
    dec = [s for s in steps if s[1] == s[2]]
    print(f"{a.dtype}: {wall:.2f} s, {n_out} output tokens, {n_out / wall:.1f} tokens/s, "
          f"{len(steps)} steps")  # fmt: skip
    print(f"steps with prefill chunks: {len(pre)}, {sum(s[0] for s in pre):.2f} s, "
          f"{sum(s[1] for s in pre)} tokens")  # fmt: skip
    print(f"pure decode steps: {len(dec)}, {sum(s[0] for s in dec):.2f} s, "
          f"{sum(s[1] for s in dec)} tokens")  # fmt: skip
    groups: dict[int, list[float]] = collections.defaultdict(list)
    for dt, _, nd in dec:
        groups[nd // 8 * 8].append(dt)
    print("| decodes per step | steps | ms per step | seconds |")
    print("|---|---:|---:|---:|")
    for k in sorted(groups):
        g = groups[k]
        print(f"| {k}-{k + 7} | {len(g)} | {1e3 * sum(g) / len(g):.1f} | {sum(g):.2f} |")


if __name__ == "__main__":
    main()
