"""Greedy output of the ModelRunner equals transformers' `generate`, token for token.

The runner is driven by a small planner written here (the real scheduler is
tested on its own): blocks from a counter, decodes first, then prefill chunks
under a token budget, sequences arriving at different steps, so that long
prompts are prefilled in several chunks while others decode.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from subway.ipc.config import EngineConfig
from subway.ipc.messages import NewSeq, Plan, SamplingParams, SeqStep, TokenRef

import reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, logprobs=5)
BLOCK_SIZE = 4


@dataclasses.dataclass
class _Seq:
    tokens: list[int]
    params: SamplingParams
    max_new: int
    arrival: int
    prompt_len: int = 0
    computed: int = 0  # positions in the KV cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    sent: bool = False
    top_ids: list[list[int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class MiniPlanner:
    """Just enough of a scheduler to drive a ModelRunner (or several TP ranks in lockstep)."""

    def __init__(self, budget: int, block_size: int = BLOCK_SIZE, groups: int = 1) -> None:
        """`groups`: the runner's KV groups (`runner.pages.num_groups`), a page each a block."""
        self.budget = budget
        self.block_size = block_size
        self.groups = groups
        self.next_block = 0
        self.step = 0
        self.seqs: dict[int, _Seq] = {}
        self.preempt_at: dict[int, tuple[int, bool]] = {}  # step -> (seq id, drop last token)
        self.finished: list[int] = []

    def add(self, prompt: list[int], max_new: int, params=GREEDY, arrival: int = 0) -> int:
        sid = len(self.seqs)
        self.seqs[sid] = _Seq(list(prompt), params, max_new, arrival)
        return sid

    def done(self) -> bool:
        return all(len(s.generated) >= s.max_new for s in self.seqs.values())

    def plan(self) -> Plan:
        preempted = []
        if self.step in self.preempt_at:
            sid, drop_last = self.preempt_at[self.step]
            s = self.seqs[sid]
            s.computed, s.blocks = 0, []  # recompute; its old blocks are simply leaked here
            if drop_last:  # as if the scheduler had discarded the token sampled last
                s.tokens.pop()
                s.top_ids.pop()
            preempted.append(sid)
        live = [
            (sid, s)
            for sid, s in self.seqs.items()
            if s.arrival <= self.step and len(s.generated) < s.max_new
        ]
        decodes = [(sid, s) for sid, s in live if s.computed and len(s.tokens) - s.computed == 1]
        prefills = [(sid, s) for sid, s in live if (sid, s) not in decodes]
        steps, new, left = [], [], self.budget
        for sid, s in decodes + prefills:
            n = min(len(s.tokens) - s.computed, left)
            if n <= 0:
                continue
            left -= n
            need = -(-(s.computed + n) // self.block_size) - len(s.blocks) // self.groups
            need *= self.groups
            blocks = list(range(self.next_block, self.next_block + need))
            self.next_block += need
            s.blocks += blocks
            if not s.sent:
                new.append(NewSeq(sid, TokenRef(ids=s.tokens), s.params))
                s.sent = True
            sample = s.computed + n == len(s.tokens)
            steps.append(SeqStep(sid, s.computed, n, blocks, sample))
        plan = Plan(self.step, steps, new, finished=self.finished, preempted=preempted)
        self.finished = []
        return plan

    def apply(self, plan: Plan, out) -> None:
        sampled = dict(zip(out.seq_ids, range(len(out.seq_ids)), strict=True))
        for st in plan.seqs:
            s = self.seqs[st.seq_id]
            s.computed += st.num_tokens
            if st.seq_id in sampled:
                j = sampled[st.seq_id]
                s.tokens.append(out.tokens[j])
                s.top_ids.append(out.top_ids[j] if out.top_ids else [])
                if len(s.generated) >= s.max_new:
                    self.finished.append(st.seq_id)
        self.step += 1

    def run(self, runner) -> None:
        self.groups = runner.pages.num_groups
        while not self.done():
            plan = self.plan()
            self.apply(plan, runner.execute(plan))


def run_with_preemptions(planner: MiniPlanner, runner, at: tuple[int, ...]) -> dict:
    """Run `planner`, preempting at each step of `at` a sequence mid-decode (the last one
    dropping its last token, as a scheduler's discarded token); per sequence, the logprob
    of each token it kept, where its sampling asked for them."""
    logprobs: dict[int, list[float]] = {sid: [] for sid in planner.seqs}
    while not planner.done():
        if planner.step in at:
            busy = [sid for sid, s in planner.seqs.items()
                    if 2 <= len(s.generated) < s.max_new and s.computed]  # fmt: skip
            assert busy, f"nothing to preempt at step {planner.step}"
            planner.preempt_at[planner.step] = (busy[0], planner.step == at[-1])
            if planner.step == at[-1] and logprobs[busy[0]]:
                logprobs[busy[0]].pop()
        plan = planner.plan()
        out = runner.execute(plan)
        planner.apply(plan, out)
        for sid, lp in zip(out.seq_ids, out.logprobs or [], strict=False):
            logprobs[sid].append(lp)
    return logprobs


def hf_greedy(path: str, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list]]:
    """(tokens, per-step top-5 ids) of transformers' greedy generate, EOS ignored, per prompt."""
    refs = (reference.hf_greedy(path, p, max_new) for p in prompts)
    return [(r.tokens, r.top5) for r in refs]


def compare(planner: MiniPlanner, expected: list[tuple[list[int], list]]) -> int:
    """Assert token equality, tolerating only verified near-ties; returns how many were tolerated."""
    near_ties = 0
    for sid, (hf_tokens, hf_top) in enumerate(expected):
        ours = planner.seqs[sid].generated
        assert len(ours) == len(hf_tokens)
        for j, (a, b) in enumerate(zip(ours, hf_tokens, strict=True)):
            if a != b:
                our_top = planner.seqs[sid].top_ids[j]
                assert a in hf_top[j] and b in our_top, (
                    f"seq {sid} diverges at token {j}: ours {ours}, transformers {hf_tokens}"
                )
                near_ties += 1
                break
    return near_ties


def make_runner(path: str, **overrides):
    from subway.worker.runner import ModelRunner

    overrides.setdefault("num_kv_blocks", 512)
    config = EngineConfig.build(path=path, block_size=BLOCK_SIZE, **overrides)
    return ModelRunner(config)


def _random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# Nine sequences; the 150-token prompt is prefilled in chunks under a 48-token budget.
LENGTHS = [5, 17, 1, 40, 150, 9, 26, 64, 3]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(tiny_models, arch):
    torch.set_num_threads(1)
    path = tiny_models[arch]
    runner = make_runner(path)
    prompts = _random_prompts(runner.vocab_size, LENGTHS)
    max_new = 12
    planner = MiniPlanner(budget=48)
    for i, p in enumerate(prompts):
        planner.add(p, max_new, arrival=i // 3)
    planner.run(runner)
    assert compare(planner, hf_greedy(path, prompts, max_new)) == 0


def test_gemma3_matches_transformers(tmp_path, default_model):
    """Gemma 3 (sliding and global layers, each with its rope base; sandwich norms of
    1 + weight, QK-norm, GeGLU, scaled embeddings) under the same chunked, batched steps;
    on the CPU its sliding layers slide, so contexts are not kept inside the window
    (tests/test_sliding_window.py runs prompts past it)."""
    from conftest import build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model("gemma3", str(tmp_path / "gemma3"), default_model)
    runner = make_runner(path)
    assert runner.max_model_len == 2048  # its positions, not its window (256)
    prompts = _random_prompts(runner.vocab_size, LENGTHS, seed=3)
    planner = MiniPlanner(budget=48)
    for i, p in enumerate(prompts):
        planner.add(p, 12, arrival=i // 3)
    planner.run(runner)
    assert compare(planner, hf_greedy(path, prompts, 12)) == 0


def test_a_gemma3_vision_language_checkpoint_serves_its_text_model(tmp_path, default_model):
    """Gemma3ForConditionalGeneration (Gemma 3 4B and larger ship so): the text model's
    weights under the checkpoint's prefix, the vision tower's left out, greedy as
    transformers' text-only generate."""
    from conftest import build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model("gemma3_vl", str(tmp_path / "gemma3_vl"), default_model)
    runner = make_runner(path)
    prompts = _random_prompts(runner.vocab_size, [5, 40, 17], seed=4)
    planner = MiniPlanner(budget=32)
    for p in prompts:
        planner.add(p, 8)
    planner.run(runner)
    assert compare(planner, hf_greedy(path, prompts, 8)) == 0


def test_real_gemma3_270m_matches_transformers(gemma3_270m):
    """Gemma 3 270M's real weights (dequantized from its Q4_K_M GGUF; 18 layers, 15 of them
    sliding, head_dim 256, a 262k vocabulary) over held-out prompts, chunked beside decodes."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(gemma3_270m)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "every morning walked down to the harbour before sunrise. One day he",
        "List three colours:",
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    runner = make_runner(gemma3_270m)
    assert runner.max_model_len == 32768  # its positions: the CPU's layers slide (window 512)
    planner = MiniPlanner(budget=16)
    for i, p in enumerate(prompts):
        planner.add(p, 16, arrival=i)
    planner.run(runner)
    assert compare(planner, hf_greedy(gemma3_270m, prompts, 16)) <= 1


def test_default_model_matches_transformers(default_model):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(default_model)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "every morning walked down to the harbour before sunrise. One day he",
        "Water boils at",
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    max_new = 20
    runner = make_runner(default_model)
    planner = MiniPlanner(budget=16)  # the long prompt takes several chunks, beside decodes
    for i, p in enumerate(prompts):
        planner.add(p, max_new, arrival=i)
    t0 = time.perf_counter()
    planner.run(runner)
    elapsed = time.perf_counter() - t0
    near_ties = compare(planner, hf_greedy(default_model, prompts, max_new))
    print(
        f"default model: {planner.step} steps in {elapsed:.2f}s, {near_ties} near-tie divergences"
    )
    assert near_ties <= 1


@pytest.mark.parametrize("drop_last", [False, True])
def test_preemption_gives_identical_output(tiny_models, drop_last):
    torch.set_num_threads(1)
    path = tiny_models["llama"]
    prompts = _random_prompts(32000, [7, 30, 12, 3], seed=1)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, logprobs=2)
    outputs = []
    for preempt in (False, True):
        runner = make_runner(path)
        planner = MiniPlanner(budget=16)
        for i, p in enumerate(prompts):
            planner.add(p, 10, params=sampled if i == 1 else GREEDY)
        if preempt:
            # Preempt the seeded sequence and a greedy one mid-decode; they recompute from 0.
            planner.preempt_at = {8: (1, drop_last), 10: (2, drop_last)}
        planner.run(runner)
        outputs.append([s.generated for s in planner.seqs.values()])
        if preempt:
            assert runner.seqs[1].block_table == planner.seqs[1].blocks
    assert outputs[0] == outputs[1]


def test_model_arch_parsing():
    from subway.worker.model_arch import parse_model_arch

    base = dict(
        vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=[2, 3],
    )  # fmt: skip
    old = parse_model_arch({**base, "architectures": ["MistralForCausalLM"], "rope_theta": 5.0})
    assert (old.family, old.rope_theta, old.rope_scaling, old.head_dim) == ("llama", 5.0, None, 16)
    assert old.eos_token_ids == [2, 3]
    scaled = parse_model_arch(
        {
            **base,
            "model_type": "llama",
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "rope_theta": 500000.0,
        },
        generation_eos=[3, 9],
    )  # fmt: skip
    assert scaled.rope_theta == 500000.0 and scaled.rope_scaling["factor"] == 8.0
    assert scaled.eos_token_ids == [2, 3, 9]
    qwen2 = parse_model_arch({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = parse_model_arch({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    with pytest.raises(ValueError, match="unsupported architecture"):
        parse_model_arch({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unsupported model_type"):
        parse_model_arch({**base, "model_type": "gpt2"})
    gptq = {**base, "model_type": "llama", "quantization_config": {"quant_method": "gptq"}}
    with pytest.raises(ValueError, match=r"quantized beforehand \(gptq\).*--quantization int8"):
        parse_model_arch(gptq)


def test_gemma3_configs_old_and_new_and_what_is_refused():
    """Gemma 3's configs, old and new; soft-capping is refused but for Gemma 2's
    (tests/test_gemma2.py), with Gemma 2's defaults: layers alternating, one rope."""
    from subway.worker.model_arch import parse_model_arch

    base = dict(
        vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=16,
        hidden_activation="gelu_pytorch_tanh", sliding_window=512,
        architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip
    old = parse_model_arch({**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                            "sliding_window_pattern": 6})  # fmt: skip
    assert old.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (old.rope_theta, old.rope_local_theta, old.sliding_window) == (1e6, 1e4, 512)
    assert old.attn_scale == 16**-0.5 and old.qk_norm and old.family == "gemma3"
    new = parse_model_arch({**base, "layer_types": ["full_attention"] * 6, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})  # fmt: skip
    assert new.sliding_window is None and new.rope_scaling["factor"] == 8.0
    for field, value in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                         ("hidden_activation", "relu"), ("layer_types", ["chunked"] * 6)):  # fmt: skip
        with pytest.raises(ValueError, match=field.split("_")[0] if field != "hidden_activation"
                           else "activation"):  # fmt: skip
            parse_model_arch({**base, field: value})
    gemma2 = {**base, "architectures": ["Gemma2ForCausalLM"], "rope_theta": 1e4,
              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # fmt: skip
    g2 = parse_model_arch(gemma2)
    assert (g2.family, g2.attn_softcap, g2.final_softcap, g2.qk_norm) == ("gemma2", 50, 30, False)
    assert g2.layer_types == ["sliding_attention", "full_attention"] * 3
    assert g2.rope_local_theta == g2.rope_theta == 1e4 and g2.attn_scale == 16**-0.5
    uncapped = parse_model_arch({**gemma2, "attn_logit_softcapping": None,
                                 "final_logit_softcapping": None})  # fmt: skip
    assert uncapped.attn_softcap == uncapped.final_softcap == 0.0
    llama = dict(base, architectures=["LlamaForCausalLM"], hidden_activation="silu")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        with pytest.raises(ValueError, match=field):
            parse_model_arch({**llama, field: 30.0})
