"""Constrained decoding in the worker: grammars (regex, JSON schema, JSON object, EBNF),
logit_bias and min_tokens, end to end through the offline `LLM` and the `ModelRunner`.

Constrained outputs match their grammar (greedy and sampled) where the same prompt
unconstrained does not; unconstrained requests that share the batch still equal
transformers' greedy tokens, through chunked prefill, preemption and overlap; a
truncated sequence rolls its matcher back; a finished or dropped one forgets it;
a grammar that does not compile fails its step (on every tensor-parallel rank).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import torch.multiprocessing as tmp
from test_model_equality import GREEDY, MiniPlanner, _random_prompts, make_runner

from subway.ipc.config import EngineConfig
from subway.ipc.messages import Grammar, NewSeq, Plan, SamplingParams, SeqStep, TokenRef
from subway.llm import LLM, Output
from subway.tools.serve_process import free_port

import reference

DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
DATE_PROMPT = "The date of the moon landing was"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
USER_ASK = "Describe a user of a web site as JSON with name, age, role, address and tags."
EBNF = 'root ::= answer ", " color "."\nanswer ::= "yes" | "no"\ncolor ::= "red" | "green" | "blue"'
EBNF_AS_REGEX = r"(yes|no), (red|green|blue)\."
SEEDS = (1, 2, 3)


def _params(grammar: Grammar | None, temperature: float = 0.0, seed: int | None = None, **kw):
    return SamplingParams(temperature=temperature, seed=seed, grammar=grammar, **kw)


@pytest.fixture(scope="module")
def llm(default_model) -> LLM:
    torch.set_num_threads(1)
    return LLM(path=default_model)


def _chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _ended_by_grammar(llm: LLM, out: Output) -> None:
    """The grammar completed: the output ends with the EOS it forces, nothing after."""
    assert out.finish_reason == "stop", out
    assert out.token_ids[-1] in llm.runner.eos_token_ids


# ---------------------------------------------------------------- each kind of grammar


def test_regex_greedy_and_sampled_match_where_unconstrained_does_not(llm):
    regex = Grammar("regex", DATE)
    runs = [_params(regex, max_tokens=30)]
    runs += [_params(regex, 0.8, seed, max_tokens=30) for seed in SEEDS]
    outs = [llm.generate([DATE_PROMPT], p)[0] for p in runs]
    for out in outs:
        _ended_by_grammar(llm, out)
        assert re.fullmatch(DATE, out.text), out.text
    assert len({o.text for o in outs}) > 1  # sampling does sample, within the grammar
    free = llm.generate([DATE_PROMPT], _params(None, max_tokens=30))[0]
    assert not re.fullmatch(DATE, free.text), free.text
    again = llm.generate([DATE_PROMPT], runs[1])[0]  # a seed still reproduces
    assert again.token_ids == outs[1].token_ids


@pytest.mark.slow
def test_json_schema_output_validates_where_unconstrained_does_not(llm):
    prompt = _chat(llm, USER_ASK)
    schema = Grammar("json_schema", json.dumps(SCHEMA))
    runs = [_params(schema, max_tokens=200)]
    runs += [_params(schema, 0.8, seed, max_tokens=200) for seed in SEEDS]
    for out in llm.generate([prompt] * len(runs), runs[0]) + [
        llm.generate([prompt], p)[0] for p in runs[1:]
    ]:
        _ended_by_grammar(llm, out)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    free = llm.generate([prompt], _params(None, max_tokens=200))[0].text
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMA)


@pytest.mark.slow
def test_json_object_output_is_an_object(llm):
    """Any object: a small model may ramble inside one (any whitespace, any keys) until
    max_tokens, so those only have to be an object so far; greedy must end."""
    prompt = _chat(llm, "Give the name and the age of a person.")
    free = llm.generate([prompt], _params(None, max_tokens=40))[0].text
    with pytest.raises(ValueError):
        json.loads(free)
    runs = [_params(Grammar("json_object"), max_tokens=80)]
    runs += [_params(Grammar("json_object"), 0.8, seed, max_tokens=80) for seed in (5, 6, 7)]
    ended = 0
    for p in runs:
        out = llm.generate([prompt], p)[0]
        assert out.text.lstrip().startswith("{"), out.text
        if out.finish_reason == "stop":
            _ended_by_grammar(llm, out)
            assert isinstance(json.loads(out.text), dict), out.text
            ended += 1
        else:
            assert out.finish_reason == "length"
            assert p.temperature > 0  # greedy ends
    assert ended >= 2


def test_ebnf_grammar(llm):
    prompt = _chat(llm, "Is the sky blue? Answer and name a colour.")
    free = llm.generate([prompt], _params(None, max_tokens=20))[0].text
    assert not re.fullmatch(EBNF_AS_REGEX, free)
    for p in (_params(Grammar("ebnf", EBNF), max_tokens=20),
              _params(Grammar("ebnf", EBNF), 0.8, 9, max_tokens=20)):  # fmt: skip
        out = llm.generate([prompt], p)[0]
        _ended_by_grammar(llm, out)
        assert re.fullmatch(EBNF_AS_REGEX, out.text), out.text


# ---------------------------------------------------------------- mixed batches


MIXED_LENGTHS = [5, 17, 30, 9, 40, 3, 22, 11]
DIGITS = r"[0-9]{3,8}"


def _mixed_run(path: str, prompts: list[list[int]], with_grammar: bool) -> tuple[dict, LLM]:
    """Greedy and seeded unconstrained requests, with or without constrained ones, under a
    16-token budget (chunked prefill), 26 KV blocks of 4 (preemption) and overlap."""
    config = EngineConfig.build(
        path=path, block_size=4, num_kv_blocks=26, max_num_batched_tokens=16, max_num_seqs=8
    )
    eng = LLM(config)
    ids: dict[str, str] = {}
    for i, p in enumerate(prompts):
        free = (
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
            if i % 2 == 0
            else SamplingParams(temperature=0.9, seed=100 + i, max_tokens=12, ignore_eos=True)
        )
        ids[eng.add(p, free)] = f"free{i}"
        if with_grammar:
            p_grammar = _params(Grammar("regex", DIGITS), 0.8 * (i % 2), 7 + i, max_tokens=12)
            ids[eng.add(p, p_grammar)] = f"digits{i}"
    outputs: dict[str, Output] = {}
    eng.run(outputs, overlap=True)
    assert eng.scheduler.num_preempted_total > 0
    return {ids[rid]: out for rid, out in outputs.items()}, eng


def test_mixed_batch_unconstrained_rows_equal_transformers(tiny_models):
    torch.set_num_threads(1)
    path = tiny_models["llama"]
    prompts = _random_prompts(49152, MIXED_LENGTHS, seed=3)
    mixed, eng = _mixed_run(path, prompts, True)
    alone, _ = _mixed_run(path, prompts, False)
    tok = eng.tokenizer
    for i, p in enumerate(prompts):
        free = mixed[f"free{i}"]
        if i % 2 == 0:
            ref = reference.hf_greedy(path, p, 12)
            assert reference.compare(free.token_ids, ref, free.top_ids) == 0
        assert free.token_ids == alone[f"free{i}"].token_ids  # a batch without any grammar
        digits = mixed[f"digits{i}"]  # at most 8 digits and EOS: within max_tokens
        assert digits.finish_reason == "stop" and digits.token_ids[-1] in eng.runner.eos_token_ids
        text = tok.decode(digits.token_ids, skip_special_tokens=True)
        assert re.fullmatch(DIGITS, text), text
    assert not eng.runner.grammars.seqs  # every finished sequence forgot its matcher


# ---------------------------------------------------------------- the runner directly


EIGHT_DIGITS = r"[0-9]{8}"


def _constrained_planner(prompts, preempt_at: dict) -> MiniPlanner:
    planner = MiniPlanner(budget=16)
    grammar = Grammar("regex", EIGHT_DIGITS)
    planner.add(prompts[0], 12, params=_params(grammar))
    planner.add(prompts[1], 12, params=GREEDY)
    planner.add(prompts[2], 12, params=_params(grammar, 0.9, 77))
    planner.preempt_at = preempt_at
    return planner


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """The tokens up to and including the first EOS (all of them if none)."""
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
    return tokens[: cut + 1]


def _run_checking_matchers(planner: MiniPlanner, runner) -> list[tuple[int, int]]:
    """Run to the end; after every step each live matcher holds exactly its sequence's
    generated tokens up to EOS. The truncations (seq id, tokens kept) it saw."""
    calls: list[tuple[int, int]] = []
    truncate = runner.grammars.truncate

    def counting(seq_id: int, generated: int) -> None:
        calls.append((seq_id, generated))
        truncate(seq_id, generated)

    runner.grammars.truncate = counting
    eos = runner.eos_token_ids
    while not planner.done():
        plan = planner.plan()
        planner.apply(plan, runner.execute(plan))
        assert set(runner.grammars.seqs) <= set(runner.seqs)  # finished: forgotten
        for sid, state in runner.grammars.seqs.items():
            st = runner.seqs[sid]
            held = _until_eos(st.tokens[st.prompt_len :], eos)
            assert state.accepted == len(held)
            assert state.matcher.is_terminated() == (held[-1:] and held[-1] in eos)
    return calls


def test_truncation_rolls_the_matcher_back_and_finished_forget(tiny_models):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    path = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _random_prompts(49152, [7, 12, 3], seed=4)
    outputs = []
    for preempt in ({}, {5: (0, True), 6: (2, True)}):
        runner = make_runner(path)
        planner = _constrained_planner(prompts, preempt)
        calls = _run_checking_matchers(planner, runner)
        assert {sid for sid, _ in calls} == ({0, 2} if preempt else set())
        outputs.append([s.generated for s in planner.seqs.values()])
        runner.execute(Plan(planner.step, [], finished=planner.finished))
        assert not runner.grammars.seqs
        for sid in (0, 2):
            held = _until_eos(outputs[-1][sid], runner.eos_token_ids)
            assert held[-1] in runner.eos_token_ids
            assert re.fullmatch(EIGHT_DIGITS, tok.decode(held[:-1])), tok.decode(held)
    assert outputs[0] == outputs[1]


def test_grammar_that_does_not_compile_fails_its_step_and_the_runner_serves_on(tiny_models):
    from subway.worker.runner import PlanError

    runner = make_runner(tiny_models["llama"])
    bad = NewSeq(0, TokenRef(ids=list(range(10, 18))), _params(Grammar("regex", "[a-")))
    good = NewSeq(1, TokenRef(ids=[5, 6, 7]), _params(None))
    first = Plan(0, [SeqStep(0, 0, 4, [0], sample=False), SeqStep(1, 0, 3, [1])], [bad, good])
    assert runner.execute(first).seq_ids == [1]  # no sample of seq 0 yet: its compile is pending
    second = Plan(1, [SeqStep(0, 4, 4, [2]), SeqStep(1, 3, 1)])
    with pytest.raises(PlanError, match="does not compile"):
        runner.execute(second)
    assert runner.drop(second) == [0, 1]
    assert not runner.grammars.seqs
    again = NewSeq(2, TokenRef(ids=[5, 6, 7]), _params(Grammar("regex", "[0-9]{2}")))
    out = runner.execute(Plan(2, [SeqStep(2, 0, 3, [3])], [again], finished=[0, 1]))
    assert out.seq_ids == [2] and 2 in runner.grammars.seqs


def _tp_rank(rank: int, path: str, addr: str, prompts: list[list[int]], out_file: str) -> None:
    from subway.worker.parallel import init_distributed
    from subway.worker.runner import ModelRunner, PlanError

    torch.set_num_threads(1)
    init_distributed(2, rank, addr, torch.device("cpu"))
    runner = ModelRunner(EngineConfig.build(path=path, block_size=4, num_kv_blocks=256), rank, 2)
    planner = _constrained_planner(prompts, {})
    planner.run(runner)
    bad = NewSeq(9, TokenRef(ids=[5, 6, 7]), _params(Grammar("ebnf", "root ::= nothing")))
    plan = Plan(planner.step, [SeqStep(9, 0, 3, [200])], [bad])
    try:
        runner.execute(plan)
        failed = "no error"
    except PlanError as e:  # on both ranks: rank 0 broadcast the failure
        failed = type(e).__name__
    runner.drop(plan)
    runner.close()
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump({"tokens": [s.generated for s in planner.seqs.values()], "failed": failed}, f)
    torch.distributed.barrier()  # neither rank tears gloo down under the other
    torch.distributed.destroy_process_group()


def test_two_ranks_rank0_masks_and_both_fail_a_bad_grammar(tiny_models, tmp_path):
    path = tiny_models["llama"]
    prompts = _random_prompts(49152, [7, 12, 3], seed=4)
    out_file = str(tmp_path / "tp")
    addr = f"127.0.0.1:{free_port()}"
    tmp.spawn(_tp_rank, args=(path, addr, prompts, out_file), nprocs=2, join=True)
    with open(out_file + ".0") as f0, open(out_file + ".1") as f1:
        rank0, rank1 = json.load(f0), json.load(f1)
    assert rank0 == rank1
    assert rank0["failed"] == "PlanError"
    runner = make_runner(path)  # one rank gives the same constrained tokens
    planner = _constrained_planner(prompts, {})
    planner.run(runner)
    assert rank0["tokens"] == [s.generated for s in planner.seqs.values()]


# ---------------------------------------------------------------- logit_bias, min_tokens


EOS_PROMPT = "hello there"


@pytest.fixture(scope="module")
def eos_model(tiny_models, tmp_path_factory):
    """The tiny Llama with one more EOS id: the 4th greedy token after EOS_PROMPT."""
    dst = str(tmp_path_factory.mktemp("eos") / "llama")
    ids, eos, greedy, _ = reference.with_early_eos(tiny_models["llama"], dst, EOS_PROMPT, 10)
    return dst, ids, eos, greedy


def test_min_tokens_and_logit_bias_end_to_end(eos_model):
    torch.set_num_threads(1)
    path, ids, eos, greedy = eos_model
    eng = LLM(path=path)
    plain = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert plain.token_ids == greedy[:4] and plain.finish_reason == "stop"
    held = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6))[0]
    assert len(held.token_ids) >= 6 and eos not in held.token_ids[:6]
    assert held.token_ids[:3] == greedy[:3] and held.token_ids[3] != eos
    # a stop id is held back too, even under ignore_eos
    stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[greedy[1]],
                          ignore_eos=True, min_tokens=3)  # fmt: skip
    out = eng.generate([ids], stop)[0]
    assert greedy[1] not in out.token_ids[:3] and out.token_ids[0] == greedy[0]
    forced = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={77: 100})
    assert eng.generate([ids], forced)[0].token_ids == [77] * 5
    banned = SamplingParams(temperature=0.0, max_tokens=3, logit_bias={greedy[0]: -100})
    assert eng.generate([ids], banned)[0].token_ids[0] != greedy[0]
    # sampled, with a seed: the bias still decides
    hot = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True,
                         logit_bias={91: 100.0})  # fmt: skip
    assert eng.generate([ids], hot)[0].token_ids == [91] * 4
