"""What serving many LoRA adapters costs: the same requests on the base model, then spread
over `--adapters` adapters of rank `--rank`, on one server, phases alternated (base, LoRA,
LoRA, base, ...) for `--rounds`; and, with `--vllm`, the same on vLLM's CPU backend with
`--enable-lora` (`tools/bench_vllm.sh`), one server after the other.

The adapters are random PEFT adapters (q, k, v, o, gate, up and down projections, the
format both servers read) of the default model, written once under the cache folder. The
workload is the standard one (`workload.generate`: 64 requests, seed 0, all at once,
`ignore_eos`, so each request yields exactly its `max_tokens`), streamed by
`bench_serving`; request i names adapter i mod N. Prints, per system and round, output
tokens/s of both phases and their ratio (base / LoRA), then the median ratio and spread.

    python -m subway.tools.bench.bench_lora --rounds 3 [--vllm] [--out docs/bench/lora.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
from collections.abc import Iterator
from typing import Any

from subway.tools.bench import bench_serving, compare, vs_vllm, workload

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model: str, out_dir: str, count: int, rank: int, seed: int = 0) -> list[str]:
    """`count` random PEFT adapters of `rank` for the model folder `model` (kept if there)."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    d = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads) * d
    inter = cfg["intermediate_size"]
    shapes = {"q_proj": (heads * d, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, heads * d), "gate_proj": (inter, hidden),
              "up_proj": (inter, hidden), "down_proj": (hidden, inter)}  # fmt: skip
    paths = []
    for i in range(count):
        path = os.path.join(out_dir, f"r{rank}-{i}")
        paths.append(path)
        if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            continue
        os.makedirs(path, exist_ok=True)
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for t in TARGETS:
                out, inp = shapes[t]
                kind = "self_attn" if t[0] in "qkvo" else "mlp"
                name = f"base_model.model.model.layers.{layer}.{kind}.{t}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.02
                tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.02
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "base_model_name_or_path": model,
        }  # fmt: skip
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return paths


def phases(rounds: int) -> list[str]:
    """base, lora, lora, base, base, lora, ...: each round's pair in the other order."""
    out: list[str] = []
    for i in range(rounds):
        out += ["base", "lora"] if i % 2 == 0 else ["lora", "base"]
    return out


def requests_for(reqs: list[workload.Request], phase: str, names: list[str]) -> list:
    if phase == "base":
        return reqs
    return [dataclasses.replace(q, model=names[i % len(names)]) for i, q in enumerate(reqs)]


def measure(url: str, reqs: list, names: list[str], rounds: int) -> list[dict[str, Any]]:
    """Warm both phases, then the alternated phases; one row per phase run."""
    warm = compare.warmup_requests()
    for phase in ("base", "lora"):
        bench_serving.benchmark(url, requests_for(warm, phase, names), progress=False)
    rows = []
    for i, phase in enumerate(phases(rounds)):
        r = bench_serving.benchmark(url, requests_for(reqs, phase, names), progress=False)
        m = r["metrics"]
        rows.append({
            "round": i // 2, "phase": phase, "output_throughput": m["output_throughput"],
            "itl_p50_ms": m["itl_ms"]["p50"], "ttft_p50_ms": m["ttft_ms"]["p50"],
            "failed": m["failed"], "output_tokens": m["output_tokens"],
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[float]:
    """Per round: base throughput / LoRA throughput."""
    by = {(r["round"], r["phase"]): r["output_throughput"] for r in rows}
    return [by[i, "base"] / by[i, "lora"] for i in sorted({r["round"] for r in rows})]


@contextlib.contextmanager
def subway(model: str, adapters: list[str], a: argparse.Namespace) -> Iterator[str]:
    flags = ["--model", model, *vs_vllm.ENGINE_FLAGS, "--enable-lora", "--lora-modules"]
    flags += [f"a{i}={p}" for i, p in enumerate(adapters)]
    flags += ["--max-loras", str(len(adapters)), "--max-lora-rank", str(a.rank)]
    with compare.subway_server("lora", flags, a.threads) as url:
        yield url


@contextlib.contextmanager
def vllm(model: str, adapters: list[str], a: argparse.Namespace) -> Iterator[str]:
    extra = [*vs_vllm.VLLM_FLAGS, "--enable-lora", "--lora-modules"]
    extra += [f"a{i}={p}" for i, p in enumerate(adapters)]
    extra += ["--max-loras", str(len(adapters)), "--max-lora-rank", str(a.rank)]
    with vs_vllm.vllm_server(model, a.threads, 4, extra) as url:
        yield url


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--vllm", action="store_true", help="vLLM's CPU backend too, after Subway")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)

    from subway.cache_dir import cache_root
    from subway.worker.default_model import ensure_default_model

    model = ensure_default_model()
    adapters = make_adapters(model, os.path.join(cache_root(), "lora-bench"), a.adapters, a.rank)
    names = [f"a{i}" for i in range(len(adapters))]
    reqs = workload.generate(workload.load_tokenizer(model), a.num_requests, 0)
    out: dict[str, Any] = {"workload": workload.summary(reqs), "adapters": a.adapters,
                           "rank": a.rank, "threads": a.threads, "systems": {}}  # fmt: skip
    systems = [("subway", subway)] + ([("vllm", vllm)] if a.vllm else [])
    for name, server in systems:
        with server(model, adapters, a) as url:
            rows = measure(url, reqs, names, a.rounds)
        rs = ratios(rows)
        out["systems"][name] = {"rows": rows, "base_over_lora": rs}
        print(f"{name}: base/LoRA throughput per round {[round(r, 3) for r in rs]}, median "
              f"{statistics.median(rs):.3f} (spread {min(rs):.3f}-{max(rs):.3f})", flush=True)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
