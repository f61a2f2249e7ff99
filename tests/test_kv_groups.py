"""Hybrid KV groups: sliding layers' pages behind their window go back to the pool
(ipc/kv_groups.py, scheduler/block_manager.py, scheduler/prefix_cache.py, worker/kv_pages.py)."""

from __future__ import annotations

import random

import pytest
import torch
from invariants import check_block_manager

from subway.ipc.config import EngineConfig
from subway.ipc.kv_groups import plan_groups, single_group
from subway.ipc.messages import SamplingParams
from subway.scheduler.block_manager import BlockManager
from subway.tools.bench.bench_windows import replay

GEMMA3_270M = ([512] * 5 + [0]) * 3  # its 18 layers: every sixth global


def test_groups_cut_the_layers_by_window():
    g = plan_groups(GEMMA3_270M, 32768)
    assert (g.windows, g.page_layers) == ((0, 512, 512, 512, 512, 512), 3)
    assert [g.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [g.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert (g.layer_group[0], g.layer_slot[0], g.layer_group[16], g.layer_slot[16]) == (1, 0, 5, 2)
    # Each (group, slot) is one layer's: no two layers share a page's slot.
    assert len(set(zip(g.layer_group, g.layer_slot, strict=True))) == 18
    g = plan_groups([24, 24, 0, 24], 2048)  # 3 sliding, 1 global: a layer a page
    assert (g.windows, g.layer_group, g.page_layers) == ((0, 24, 24, 24), (1, 2, 0, 3), 1)
    g = plan_groups([4096, 0, 4096, 0], 8192)  # Gemma 2: alternating
    assert (g.windows, g.page_layers) == ((0, 4096), 2)
    assert plan_groups([21, 21], 2048) == single_group(2, 21)  # Mistral: one sliding group
    assert plan_groups([512, 0], 512) == single_group(2)  # no sequence outgrows the window
    assert plan_groups([0, 0, 0], 100) == single_group(3)


def _grow(bm: BlockManager, sid: int, n: int) -> list[int]:
    new = bm.allocate(sid, n)
    check_block_manager(bm)
    return new


def test_pages_behind_a_window_go_back_to_the_pool():
    """Group 1 slides over 8 tokens (blocks of 4): once the next position is p, its block j
    is released when (j + 1) * 4 <= p - 8 + 1; group 0 keeps every block."""
    bm = BlockManager(num_blocks=40, block_size=4, windows=(0, 8))
    assert _grow(bm, 1, 6) != [] and len(bm.block_table(1)) == 4  # 2 blocks, 2 pages each
    assert bm.num_used_blocks == 4
    for pos in range(6, 40):
        bm.allocate(1, 1) if pos % 4 else _grow(bm, 1, 1)
        table = bm.block_table(1)
        held = [j for j in range(len(table) // 2) if table[2 * j + 1] >= 0]
        dead = max(0, pos - 8 + 1) // 4  # released at the last allocation, at most one behind
        assert held and held[0] >= dead - 1 and held == list(range(held[0], len(table) // 2))
        assert all(b >= 0 for b in table[::2])  # the global group holds all
    assert bm.num_used_blocks == 10 + 2  # 10 global pages; position 39's window: keys 32-39
    bm.free(1)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 40
    check_block_manager(bm)


@pytest.mark.parametrize(
    "layers",
    [[512] * 5 + [0], GEMMA3_270M],
    ids=["5-of-6-sliding", "gemma3-270m"],
)
def test_a_long_conversation_holds_about_a_quarter_of_the_kv(layers):
    """The issue's figure: a 4k-token conversation on a model whose layers are 5 of 6
    sliding (window 512) holds under a third of the KV a full-attention cache would:
    held pages x layers a page, over the 4096 / 16 blocks of every layer."""
    g = plan_groups(layers, 32768)
    bm, peak = replay(g.windows, 4096, 512, 16)  # (the benchmark's replay)
    check_block_manager(bm)
    end = bm.num_used_blocks
    full = 4096 // 16 * len(layers)
    # Global layers: 256 blocks each; sliding: position 4095's window, keys 3584-4095 (32
    # blocks), and while decoding up to 33 (a window across a block's edge).
    assert end * g.page_layers == (256 + 5 * 32) * len(layers) // 6
    assert peak * g.page_layers == (256 + 5 * 33) * len(layers) // 6
    assert end * g.page_layers / full < 0.28 and peak * g.page_layers / full < 0.28


def test_a_prefix_hit_takes_what_its_windows_read():
    """A hit of L blocks takes group 0's pages of all of them, and the sliding group's only
    for the blocks its window reaches from L * block_size on; a page missing there (evicted)
    ends the hit before it."""
    bs, w = 4, 8
    bm = BlockManager(num_blocks=64, block_size=bs, enable_caching=True, windows=(0, w))
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks
    bm.allocate(1, 30)
    bm.cache_blocks(1, prompt, [], 30)
    bm.free(1)
    check_block_manager(bm)
    hits = bm.lookup(prompt + [7], [], 7)
    assert len(hits) == 14  # 7 blocks: the first 5 need no sliding page (from 28 - 8 + 1)
    assert all(b >= 0 for b in hits[::2])
    assert [b >= 0 for b in hits[1::2]] == [False] * 5 + [True] * 2
    # Evict block 6's sliding page: the hit ends before block 6 (block 5's window then
    # reaches block 4, whose page is cached too).
    evicted = hits[13]
    bm._stamp[evicted] = 0
    bm._num_evictable -= 1
    del bm._cache[bm._key[evicted]]
    bm._tokens[evicted] = None
    bm._free.append(evicted)
    check_block_manager(bm)
    hits = bm.lookup(prompt + [7], [], 7)
    assert len(hits) == 12 and [b >= 0 for b in hits[1::2]] == [False] * 4 + [True] * 2
    table = bm.allocate_with_prefix(2, hits, 31 - 24)
    assert table[:12] == hits and bm.num_claimed(2) == 31
    check_block_manager(bm)


@pytest.mark.parametrize("windows", [(0, 6, 6), (10,), (0, 9)])
def test_random_workload_with_windows_never_leaks_and_hits_read_their_tokens(windows):
    """Sequences grow, share prefixes, finish, at random; every held page of a full block
    holds the KV of that block's tokens in its group (a shadow of what was written)."""
    rng = random.Random(2)
    bs, G = 4, len(windows)
    bm = BlockManager(num_blocks=90, block_size=bs, enable_caching=True, windows=windows)
    prefixes = [[rng.randrange(5) for _ in range(24)] for _ in range(3)]
    live: dict[int, list[int]] = {}
    written: dict[int, tuple] = {}  # page -> (group, the tokens up to its block's end)

    def check(sid: int, new: list[int]) -> None:
        for b in new:
            written.pop(b, None)
        table, toks = bm.block_table(sid), live[sid]
        for j in range(min(len(table) // G, len(toks) // bs)):
            for k in range(G):
                b = table[j * G + k]
                if b >= 0:
                    want = (k, tuple(toks[: (j + 1) * bs]))
                    assert written.setdefault(b, want) == want, (sid, j, k)

    for i in range(3000):
        sid = rng.randrange(12)
        if sid in live and rng.random() < 0.25:
            bm.cache_blocks(sid, live[sid], [], bm.num_claimed(sid))
            bm.free(sid)
            del live[sid]
        elif sid in live:
            n = rng.randrange(1, 7)
            if bm.can_allocate(sid, n):
                done = bm.num_claimed(sid)
                new = bm.allocate(sid, n)
                live[sid] += [rng.randrange(5) for _ in range(n)]
                check(sid, new)
                bm.cache_blocks(sid, live[sid], [], done)
        else:
            toks = rng.choice(prefixes)[: rng.randrange(1, 25)] + [rng.randrange(5)]
            hits = bm.lookup(toks, [], (len(toks) - 1) // bs)
            n = len(toks) - bm.slots(hits)
            if bm.admission_cost(hits, n) <= bm.num_free_blocks:
                table = bm.allocate_with_prefix(sid, hits, n)
                live[sid] = toks
                check(sid, [b for b in table[len(hits) :] if b >= 0])
        if i % 25 == 0:
            check_block_manager(bm)
    for sid in list(live):
        bm.free(sid)
    check_block_manager(bm)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 90
    assert bm.num_evictions > 50


def test_capacity_counts_what_a_window_holds():
    """The longest sequence the pool holds alone (the scheduler's max_model_len bound)."""
    assert BlockManager(100, 4).capacity_tokens(16) == 400
    assert BlockManager(100, 4, windows=(0, 0)).capacity_tokens(16) == 200
    # One global group, one sliding over 8 tokens: the window and a chunk (6 pages) aside.
    assert BlockManager(100, 4, windows=(0, 8)).capacity_tokens(16) == (100 - 7) * 4
    assert BlockManager(100, 4, windows=(8,)).capacity_tokens(16) >= 1 << 30
    assert BlockManager(5, 4, windows=(8,)).capacity_tokens(16) == 20  # not even that: no gain


# ------------------------------------------------------------------ through the engine


def _gemma_5_of_6(out_dir: str, tokenizer_dir: str, window: int) -> str:
    """A tiny random Gemma 3 whose layers are 5 of 6 sliding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
        sliding_window=window, layer_types=kinds, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _serve(engine, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], int]:
    """Outputs and the most sequences that ran at once."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    ids = [engine.add(p, sp) for p in prompts]
    outputs: dict = {}
    peak = [0]

    def on_deltas(deltas) -> None:
        from subway.llm import Output

        for d in deltas:
            outputs.setdefault(d.request_id, Output()).add(d)
        peak[0] = max(peak[0], engine.scheduler.num_running)

    engine.core.run(on_deltas)
    return [outputs[i].token_ids for i in ids], peak[0]


def test_the_same_kv_memory_runs_more_long_prompts_at_once(tmp_path, default_model):
    """Long prompts on a 5-of-6-sliding model under the same --kv-cache-memory (2.5 of
    the 340-token sequences in a full cache): the hybrid cache runs all 6 at once, without
    a preemption, with the same greedy outputs."""
    from subway.llm import LLM

    torch.set_num_threads(1)
    path = _gemma_5_of_6(str(tmp_path / "g"), default_model, window=32)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(300)] for _ in range(6)]
    per_seq = 6 * 2 * 32 * 4 * 320  # layers x (k, v) x head_dim x float32 x tokens
    memory = int(2.5 * per_seq)
    got = {}
    for hybrid in (False, True):
        config = EngineConfig.build(
            path=path, run_id="kvg", block_size=16, threads=1, kv_cache_memory=memory,
            max_num_batched_tokens=128, hybrid_kv_cache=hybrid, enable_prefix_caching=False,
        )  # fmt: skip
        engine = LLM(config)
        assert engine.runner.pages.num_groups == (6 if hybrid else 1)
        outs, peak = _serve(engine, prompts, 40)
        got[hybrid] = (outs, peak, engine.scheduler.engine_stats().num_preempted_total)
    assert got[True][0] == got[False][0]
    # The full cache holds 2 (a third admitted is preempted again and again); hybrid, all.
    assert got[False][1] <= 3 and got[False][2] > 0, got[False][1:]
    assert got[True][1:] == (6, 0)
