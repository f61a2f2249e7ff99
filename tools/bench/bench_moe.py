"""Mixture of experts: the model pair for serving benchmarks, and the expert kernel alone.

`make --out DIR` writes two random-weight models with SmolLM2's tokenizer (from the default
model's folder): `DIR/moe`, a Qwen3-MoE of 8 experts with 2 a token, and `DIR/dense`, the
Qwen3 with the same active parameters per token (its MLP as wide as two experts), the same
attention, embeddings and layer count.

`serve --dir DIR` serves both (bfloat16, vs_vllm's engine flags; the idle one waits) and
runs the standard workload (64 requests, exact output lengths) against each at every
`--concurrencies`, A (dense) and B (MoE) alternating for `--rounds` rounds
(`url_compare.compare`): the MoE's throughput over the dense model's, round by round.

`kernel` times one routed layer's MLP (worker/moe.py `Experts`: tokens grouped by expert,
each expert's MLP once on its tokens, the packed linears a served model runs) against a
per-expert loop in PyTorch (transformers' own: each expert in turn, its tokens found by a
mask, plain `F.linear`), on the same weights and inputs, at several batch sizes, alternating
rounds in one process; it prints the median microseconds per call and the median ratio.

    python -m subway.tools.bench.bench_moe make --out /tmp/moe-pair
    python -m subway.tools.bench.bench_moe serve --dir /tmp/moe-pair [--rounds 3]
    python -m subway.tools.bench.bench_moe kernel [--rows 1,16,64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)  # fmt: skip
EXPERTS, TOP_K, EXPERT_SIZE = 8, 2, 1024


def make(out: str, tokenizer_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(SHAPES, vocab_size=len(tok), tie_word_embeddings=True,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    configs = {
        "moe": Qwen3MoeConfig(
            **common,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_SIZE,
            norm_topk_prob=True,
            intermediate_size=EXPERT_SIZE * TOP_K,
        ),  # fmt: skip
        "dense": Qwen3Config(**common, intermediate_size=EXPERT_SIZE * TOP_K),
    }
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
        path = f"{out}/{name}"
        model.save_pretrained(path)
        tok.save_pretrained(path)
        active = sum(p.numel() for n, p in model.named_parameters() if "experts" not in n)
        if name == "moe":
            active += model.config.num_hidden_layers * TOP_K * 3 * 1024 * EXPERT_SIZE
        total = sum(p.numel() for p in model.parameters())
        print(f"{path}: {total / 1e6:.0f}M parameters, {active / 1e6:.0f}M active a token")


def per_expert_loop(x, router, gate_up, down, top_k: int) -> torch.Tensor:
    """transformers' MoE forward (renormalised top-k): each expert in turn, by a mask."""
    probs = F.linear(x, router).float().softmax(-1)
    w, idx = probs.topk(top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    mask = F.one_hot(idx, num_classes=len(gate_up)).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        slot, rows = torch.where(mask[e[0]])
        g, u = F.linear(x[rows], gate_up[e[0]]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e[0]]) * w[rows, slot, None]
        out.index_add_(0, rows, y.to(x.dtype))
    return out


def _layer(dtype: torch.dtype, hidden: int, size: int, experts: int, top_k: int):
    from subway.kernels.dispatch import choose_kernels
    from subway.worker.layers import PackedLinear
    from subway.worker.model_arch import ModelArch
    from subway.worker.moe import Experts
    from subway.worker.parallel import TensorParallel

    arch = ModelArch(
        family="qwen3_moe", vocab_size=8, hidden_size=hidden, intermediate_size=size,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=hidden, rms_norm_eps=1e-6,
        rope_theta=1e4, rope_scaling=None, max_position_embeddings=8,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
        qk_norm=False, dtype=dtype, num_experts=experts, experts_per_token=top_k,
        moe_intermediate_size=size, norm_topk_prob=True, moe_layers=[True],
    )  # fmt: skip
    kernels = choose_kernels()
    layer = Experts(arch, TensorParallel(), kernels, dtype, torch.device("cpu"),
                    np.zeros(experts, dtype=np.int64))  # fmt: skip
    with torch.no_grad():
        layer.router.normal_(0, 0.05)
        for ex in layer.experts:
            ex.gate_up.weight.normal_(0, 0.02)
            ex.down_proj.weight.normal_(0, 0.02)
    gate_up = [ex.gate_up.weight.detach().clone() for ex in layer.experts]
    down = [ex.down_proj.weight.detach().clone() for ex in layer.experts]
    for m in layer.modules():
        if isinstance(m, PackedLinear):
            m.pack(16, kernels.small_linear, kernels.small_linear_rows, False,
                   kernels.small_linear_pack)  # fmt: skip
    return layer, gate_up, down


def _time(fn, args: tuple, calls: int) -> float:
    """Microseconds a call of `fn(*args)`, over `calls` calls."""
    t = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t) / calls * 1e6


def kernel(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"one routed layer: hidden {args.hidden}, {args.experts} experts of {args.size}, "
          f"top {args.top_k}; {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'dtype':>9} {'rows':>5} {'grouped us':>11} {'loop us':>9} {'loop/grouped':>13} spread")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        layer, gate_up, down = _layer(dtype, args.hidden, args.size, args.experts, args.top_k)
        for rows in rows_list:
            x = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(rows))
            x = x.to(dtype)
            # transformers' router runs in the model's dtype (ours in float32)
            loop = (per_expert_loop, x, layer.router.to(dtype), gate_up, down, args.top_k)
            with torch.inference_mode():
                err = (layer(x).float() - per_expert_loop(*loop[1:]).float()).abs().max().item()
                times: dict[str, list[float]] = {"grouped": [], "loop": []}
                for _ in range(args.rounds):
                    times["grouped"].append(_time(layer, (x,), args.calls))
                    times["loop"].append(_time(loop[0], loop[1:], args.calls))
            ratios = [b / a for a, b in zip(times["grouped"], times["loop"], strict=True)]
            g, lo = statistics.median(times["grouped"]), statistics.median(times["loop"])
            print(f"{dtype_name:>9} {rows:>5} {g:>11.0f} {lo:>9.0f} "
                  f"{statistics.median(ratios):>12.2f}x {min(ratios):.2f}-{max(ratios):.2f}"
                  f"  (max |diff| {err:.1e})")  # fmt: skip


def serve(args: argparse.Namespace) -> None:
    import contextlib
    import json

    from subway.tools.bench import compare, url_compare, vs_vllm, workload

    reqs = workload.generate(workload.load_tokenizer(f"{args.dir}/moe"), args.num_requests, 0)
    out: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        urls = {
            side: stack.enter_context(compare.subway_server(
                f"moe-{name}", vs_vllm.subway_flags(f"--model {args.dir}/{name}"), args.threads))
            for side, name in (("a", "dense"), ("b", "moe"))
        }  # fmt: skip
        for c in (int(x) for x in args.concurrencies.split(",")):
            print(f"== max concurrency {c} (A dense, B MoE)", flush=True)
            result = url_compare.compare(urls, reqs, args.rounds, max_concurrency=c)
            print(url_compare.format_table(result), flush=True)
            out[f"c{c}"] = result
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="write the MoE and its dense twin")
    mk.add_argument("--out", required=True)
    mk.add_argument("--tokenizer", default="", help="a folder with SmolLM2's tokenizer")
    k = sub.add_parser("kernel", help="the grouped experts against a per-expert loop")
    k.add_argument("--rows", default="1,16,64")
    k.add_argument("--rounds", type=int, default=7)
    k.add_argument("--calls", type=int, default=20)
    k.add_argument("--dtypes", default="bfloat16,float32")
    k.add_argument("--hidden", type=int, default=SHAPES["hidden_size"])
    k.add_argument("--size", type=int, default=EXPERT_SIZE)
    k.add_argument("--experts", type=int, default=EXPERTS)
    k.add_argument("--top-k", type=int, default=TOP_K)
    k.add_argument("--threads", type=int, default=0)
    s = sub.add_parser("serve", help="the MoE against its dense twin, served, alternating")
    s.add_argument("--dir", required=True, help="make's --out")
    s.add_argument("--concurrencies", default="16,64")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--num-requests", type=int, default=64)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "make":
        from subway.worker.default_model import ensure_default_model

        make(args.out, args.tokenizer or ensure_default_model(quiet=True))
    else:
        kernel(args)


if __name__ == "__main__":
    main()
