"""Two tensor-parallel ranks (gloo, two processes) give transformers' greedy tokens, and
rank 0 pools embedding prefills in the same steps as transformers' hidden states."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp

from subway.ipc.config import EngineConfig
from subway.ipc.messages import POOLINGS, SamplingParams
from subway.tools.serve_process import free_port

LENGTHS = [5, 23, 1, 40, 9, 12]
MAX_NEW = 8


def _rank_main(rank: int, path: str, addr: str, prompts: list[list[int]], out_file: str) -> None:
    from test_model_equality import BLOCK_SIZE, MiniPlanner

    from subway.worker.parallel import init_distributed
    from subway.worker.runner import ModelRunner

    torch.set_num_threads(1)
    init_distributed(2, rank, addr, torch.device("cpu"))
    config = EngineConfig.build(path=path, block_size=BLOCK_SIZE, num_kv_blocks=256)
    runner = ModelRunner(config, rank, 2)
    planner = MiniPlanner(budget=32, groups=runner.pages.num_groups)  # the same steps on every rank
    for i, p in enumerate(prompts):
        planner.add(p, MAX_NEW, arrival=i // 2)
    pooled = {  # embedding prefills in the same steps, chunked as the others (worker/pooling.py)
        planner.add(p, 1, SamplingParams(max_tokens=1, pooling=POOLINGS[i % 2]), i // 2): i
        for i, p in enumerate(prompts)
    }
    vectors: dict[int, list[float]] = {}
    while not planner.done():
        plan = planner.plan()
        out = runner.execute(plan)
        for sid, v in zip(out.seq_ids, out.embeddings or [], strict=False):
            if v is not None:
                vectors[pooled[sid]] = np.frombuffer(v, dtype="<f4").tolist()
        planner.apply(plan, out)
    torch.distributed.destroy_process_group()
    with open(f"{out_file}.{rank}", "w") as f:
        generated = [s.generated for sid, s in planner.seqs.items() if sid not in pooled]
        json.dump({"tokens": generated, "vectors": vectors}, f)


def _mqa_llama(root: str) -> str:
    """A tiny Llama with one KV head, so that two ranks replicate it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, attention_bias=True,
    )  # fmt: skip
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.08)
    path = os.path.join(root, "mqa")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "qwen2",
        "qwen3",
        "mqa",
        "gemma3",
        "gemma2",
        pytest.param("default", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_match_transformers(tiny_models, default_model, tmp_path, arch):
    """`default` is SmolLM2-135M: 9 query heads in 3 KV groups, split unevenly (2 + 1)."""
    from test_model_equality import _random_prompts, hf_greedy

    paths = {**tiny_models, "default": default_model}
    if arch in ("gemma3", "gemma2"):
        from conftest import build_tiny_model

        paths[arch] = build_tiny_model(arch, str(tmp_path / arch), default_model)
    path = _mqa_llama(str(tmp_path)) if arch == "mqa" else paths[arch]
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = _random_prompts(vocab, LENGTHS, seed=2)
    out_file = str(tmp_path / "tokens")
    addr = f"127.0.0.1:{free_port()}"
    tmp.spawn(_rank_main, args=(path, addr, prompts, out_file), nprocs=2, join=True)
    with open(out_file + ".0") as f0, open(out_file + ".1") as f1:
        rank0, rank1 = json.load(f0), json.load(f1)
    assert rank0["tokens"] == rank1["tokens"]  # rank 0 broadcast its samples
    expected = [tokens for tokens, _ in hf_greedy(path, prompts, MAX_NEW)]
    assert rank0["tokens"] == expected
    assert rank1["vectors"] == {}  # rank 0 pools
    for i, want in enumerate(hf_pooled(path, prompts)):
        got = np.array(rank0["vectors"][str(i)])
        assert float(np.dot(got, want) / np.linalg.norm(got)) >= 0.9999, i


def hf_pooled(path: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """transformers' final hidden states of each prompt, pooled as POOLINGS[i % 2], unit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for i, p in enumerate(prompts):
        with torch.no_grad():
            h = model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0]
        v = h[-1] if POOLINGS[i % 2] == "last" else h.mean(0)
        out.append((v / v.norm()).numpy())
    return out


def _stalling_rank(rank: int, addr: str, out_file: str) -> None:
    """Rank 0 all-reduces; rank 1 joins the group and never does (a stopped peer)."""
    import time

    from subway.worker.parallel import init_distributed

    init_distributed(2, rank, addr, torch.device("cpu"), timeout=2.0)
    if rank == 1:
        time.sleep(30)  # the stalled peer; killed by the test when rank 0 has answered
        return
    t0 = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(4))
        outcome = "completed"
    except RuntimeError as e:
        outcome = f"raised {type(e).__name__}"
    with open(out_file, "w") as f:
        json.dump({"outcome": outcome, "seconds": time.monotonic() - t0}, f)


def test_a_collective_waiting_for_a_stalled_rank_times_out(tmp_path):
    """--collective-timeout: a rank waiting for one that never comes raises (then the
    worker reports the error), instead of hanging for torch's default of 30 minutes."""
    import multiprocessing as mp

    out = str(tmp_path / "outcome.json")
    addr = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_stalling_rank, args=(r, addr, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[0].join(60)
    procs[1].kill()
    procs[1].join(10)
    with open(out) as f:
        got = json.load(f)
    assert got["outcome"].startswith("raised") and got["seconds"] < 20, got
