"""Mixture-of-experts models (worker/moe.py): Qwen3-MoE, Qwen2-MoE (a shared expert), Mixtral
and OLMoE (q and k normed over all heads) give transformers' greedy tokens under chunked,
batched, preempted, prefix-cached and speculative steps; the grouped expert kernel equals
transformers' per-expert loop; routing is counted for /metrics."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_model_equality import (
    LENGTHS,
    MiniPlanner,
    _random_prompts,
    compare,
    hf_greedy,
    make_runner,
)

from subway.ipc.messages import EngineStats, SamplingParams

import reference
from conftest import MOE_CONFIGS, build_tiny_model

MOE_ARCHS = sorted(MOE_CONFIGS)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, default_model) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {a: build_tiny_model(a, str(root / a), default_model) for a in MOE_ARCHS}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_models_match_transformers(moe_models, arch):
    """Nine requests arriving over several steps, the long prompt in chunks beside decodes,
    one sequence preempted (recomputed) midway."""
    torch.set_num_threads(1)
    path = moe_models[arch]
    runner = make_runner(path)
    prompts = _random_prompts(runner.vocab_size, LENGTHS, seed=5)
    planner = MiniPlanner(budget=48)
    for i, p in enumerate(prompts):
        planner.add(p, 12, arrival=i // 3)
    planner.preempt_at[9] = (3, False)
    scheduled, execute = [], runner.execute
    runner.execute = lambda plan: scheduled.append(plan) or execute(plan)
    planner.run(runner)
    assert compare(planner, hf_greedy(path, prompts, 12)) == 0
    tokens = sum(s.num_tokens for plan in scheduled for s in plan.seqs)
    counts = runner.model.expert_tokens  # every token took 2 experts in each routed layer
    assert counts.sum() == tokens * 2 * sum(runner.model.arch.moe_layers) and counts.min() > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_with_prefix_caching_preemption_and_speculation(moe_models, arch):
    """Through the engine: n-gram drafts verified, a shared prefix cached, a pool small
    enough to preempt."""
    from subway.llm import LLM

    torch.set_num_threads(1)
    path = moe_models[arch]
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    eng = LLM(path=path, speculative_config=ngram, num_kv_blocks=24, block_size=4,
              max_num_batched_tokens=32)  # fmt: skip
    rng = np.random.default_rng(7)
    motif = rng.integers(3, eng.runner.vocab_size, 6).tolist()
    shared = rng.integers(3, eng.runner.vocab_size, 24).tolist()
    prompts = [shared + motif * 3 + [int(t)] for t in rng.integers(3, 200, 8)]
    max_new = 16
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference.hf_greedy(path, p, max_new).tokens
    s = eng.scheduler.engine_stats()
    assert s.spec_draft_tokens_total > 0 and s.num_preempted_total > 0
    assert eng.scheduler.stats.prefix_hits_total > 0


def _per_expert_loop(x, router, experts, top_k, renormalise, float_weights):
    """transformers' reference: each expert in turn, its tokens found by a mask."""
    probs = F.linear(x, router).float().softmax(-1)
    w, idx = probs.topk(top_k, dim=-1)
    if renormalise:
        w /= w.sum(-1, keepdim=True)
    w = w if float_weights else w.to(x.dtype)
    out = torch.zeros_like(x)
    for e, (gate_up, down) in enumerate(experts):
        rows, slot = torch.where(idx == e)
        if rows.numel():
            g, u = F.linear(x[rows], gate_up).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, down) * w[rows, slot, None]
            out.index_add_(0, rows, y.to(x.dtype))
    return out


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_grouped_experts_equal_the_per_expert_loop(rows, family):
    from subway.kernels.dispatch import choose_kernels
    from subway.worker.model_arch import ModelArch
    from subway.worker.moe import Experts
    from subway.worker.parallel import TensorParallel

    torch.manual_seed(rows)
    h, size, n_exp = 64, 96, 8
    arch = ModelArch(
        family=family, vocab_size=10, hidden_size=h, intermediate_size=size, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, dtype=torch.float32,
        num_experts=n_exp, experts_per_token=2, moe_intermediate_size=size,
        norm_topk_prob=family == "mixtral", moe_layers=[True],
    )  # fmt: skip
    tokens = np.zeros(n_exp, dtype=np.int64)
    kernels = choose_kernels()
    moe = Experts(arch, TensorParallel(), kernels, torch.float32, torch.device("cpu"), tokens)
    ref = []
    with torch.no_grad():
        moe.router.normal_(0, 0.5)
        for ex in moe.experts:
            ex.gate_up.weight.normal_(0, 0.1)
            ex.down_proj.weight.normal_(0, 0.1)
            ref.append((ex.gate_up.weight.clone(), ex.down_proj.weight.clone()))
        x = torch.randn(rows, h)
        got = moe(x)
    want = _per_expert_loop(x, moe.router, ref, 2, family == "mixtral", family == "mixtral")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    idx = F.linear(x, moe.router).topk(2, dim=-1).indices
    assert tokens.tolist() == torch.bincount(idx.view(-1), minlength=n_exp).tolist()


def test_int8_quantizes_every_expert(moe_models):
    """--quantization int8: each expert's linears run 8-bit; the router stays float."""
    torch.set_num_threads(1)
    runner = make_runner(moe_models["qwen2_moe"], quantization="int8", dtype="bfloat16")
    mlp = runner.model.layers[0].mlp
    assert all(e.gate_up.int8 is not None and e.down_proj.int8 is not None for e in mlp.experts)
    assert mlp.shared.gate_up.int8 is not None and mlp.router.dtype == torch.float32
    prompts = _random_prompts(runner.vocab_size, [9, 30], seed=6)
    planner = MiniPlanner(budget=48)
    for p in prompts:
        planner.add(p, 8)
    planner.run(runner)
    assert all(len(s.generated) == 8 for s in planner.seqs.values())


def test_moe_configs_refused_by_name(tmp_path):
    from subway.worker.model_arch import parse_model_arch

    base = {"architectures": ["OlmoeForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    arch = parse_model_arch(base)
    assert arch.family == "olmoe" and arch.qk_norm_full and arch.moe_layers == [True]
    with pytest.raises(ValueError, match="clip_qkv"):
        parse_model_arch({**base, "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="not a mixture of experts"):
        parse_model_arch({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="unsupported architecture"):
        parse_model_arch({**base, "architectures": ["DeepseekV3ForCausalLM"]})
    qwen = parse_model_arch({**base, "architectures": ["Qwen3MoeForCausalLM"],
                             "num_hidden_layers": 4, "decoder_sparse_step": 2,
                             "mlp_only_layers": [3]})  # fmt: skip
    assert qwen.moe_layers == [False, True, False, False]


def test_a_checkpoint_missing_an_expert_is_refused(moe_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = moe_models["mixtral"]
    out = tmp_path / "broken"
    out.mkdir()
    for name in os.listdir(src):
        if name != "model.safetensors":
            (out / name).write_bytes(open(os.path.join(src, name), "rb").read())
    weights = load_file(os.path.join(src, "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.5\.down_proj"):
        make_runner(str(out))


def test_expert_counts_reach_metrics():
    """Rank 0's counts, checked by the scheduler, on /metrics: one series per expert (summed
    over layers) and the load imbalance, max over mean."""
    from subway.frontend.metrics import Metrics

    m = Metrics("m")
    m.observe_stats(EngineStats(moe_expert_tokens_total=[6, 2, 0, 0]))
    lines = m.render().decode().splitlines()
    series = {x.split()[0]: float(x.split()[1]) for x in lines if x.startswith("subway:moe")}
    tokens = 'subway:moe_expert_tokens_total{engine="0",expert="%d",model_name="m",role="both"}'
    assert [series[tokens % e] for e in range(4)] == [6, 2, 0, 0]
    imbalance = 'subway:moe_expert_load_imbalance{engine="0",model_name="m",role="both"}'
    assert series[imbalance] == pytest.approx(3.0)


def test_a_result_with_bad_expert_counts_is_refused():
    from subway.ipc.messages import MAX_EXPERTS, Plan, StepResult, TokenRef
    from subway.scheduler.worker_link import check_result

    plan = Plan(1, [], [])
    ok = StepResult(1, [], TokenRef(ids=[]), moe_expert_tokens=[3, 0])
    assert check_result(ok, [], [], 10, plan) is None
    for bad in ([1, -1], [0] * (MAX_EXPERTS + 1)):
        msg = StepResult(1, [], TokenRef(ids=[]), moe_expert_tokens=bad)
        assert "expert token counts" in check_result(msg, [], [], 10, plan)


def test_two_ranks_shard_the_experts(moe_models, tmp_path):
    """Tensor parallelism of 2 on Qwen2-MoE (each expert's MLP and the shared one split by
    their intermediate size, one all-reduce a layer) and OLMoE (its q/k norm's squares
    summed across ranks)."""
    import torch.multiprocessing as tmp
    from test_tensor_parallel import MAX_NEW, _rank_main

    from subway.tools.serve_process import free_port

    for arch in ("qwen2_moe", "olmoe"):
        path = moe_models[arch]
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompts = _random_prompts(vocab, [5, 23, 1, 40], seed=8)
        out_file = str(tmp_path / f"tokens-{arch}")
        tmp.spawn(_rank_main, args=(path, f"127.0.0.1:{free_port()}", prompts, out_file),
                  nprocs=2, join=True)  # fmt: skip
        with open(out_file + ".0") as f:
            got = json.load(f)["tokens"]
        assert got == [t for t, _ in hf_greedy(path, prompts, MAX_NEW)], arch


def test_served_moe_counts_its_experts_on_metrics(moe_models):
    """Every process: rank 0's counts reach /metrics through the scheduler; the greedy
    completion is transformers'."""
    import httpx
    from transformers import AutoTokenizer

    from serving import Server

    path = moe_models["qwen3_moe"]
    tok = AutoTokenizer.from_pretrained(path)
    prompt = _random_prompts(len(tok), [20], seed=9)[0]
    server = Server(path, "--max-model-len", "512")
    try:
        with httpx.Client(timeout=120) as c:
            body = {"model": "qwen3_moe", "prompt": prompt, "max_tokens": 10, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = c.post(server.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tok.decode(
                reference.hf_greedy(path, prompt, 10).tokens
            )
            metrics = c.get(server.url + "/metrics").text
    finally:
        server.stop()
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("subway:moe_expert_tokens_total{")
    ]
    # 20 prompt tokens and 9 decoded, 2 experts each in 2 routed layers (the middle is dense)
    assert len(counts) == 8 and sum(counts) == (20 + 9) * 2 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_adds_its_experts_as_the_grouped_path_does(dtype):
    """A single stream's decode skips the sort and gathers; its sums are the same."""
    from subway.tools.bench.bench_moe import _layer

    layer, _, _ = _layer(dtype, 64, 96, 8, 2)
    with torch.inference_mode():
        for seed in range(5):
            x = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
            probs = F.linear(x.float(), layer.router).softmax(-1)
            w, chosen = probs.topk(2, dim=-1)
            w = (w / w.sum(-1, keepdim=True)).to(dtype)
            assert torch.equal(layer._one_token(x, w, chosen), layer._grouped(x, w, chosen))
