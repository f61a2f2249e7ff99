"""A JSON output closes before its budget runs out (`worker/json_budget.py`).

The closing set (which token texts qualify), the window (which rows), the narrowing
(the intersection where it is not empty; else the grammar's mask less whitespace, or
untouched where it allows only whitespace; rows outside their window untouched bit
for bit; the same whatever else is in the batch), the sampler that applies it, and a `subway serve` of a tiny random-weight
model whose free-form strings ran to `max_tokens` and now close and validate.
Also the seeded noise's zero that let a masked token be sampled (found by
`tools/bench/bench_json_validity.py`).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import pytest
import torch

from subway.ipc.messages import Grammar, SamplingParams
from subway.worker.grammar import Grammars, TokenMask
from subway.worker.json_budget import (
    DEFAULT_WINDOW,
    WINDOW_ENV,
    ClosingSet,
    bracket_ids,
    closing_token_ids,
    ends_string,
    in_window,
    is_blank,
    is_closing,
    string_closing_token_ids,
    token_bitmask,
    window_from_env,
)
from subway.worker.sampler import Sampler, SampleRequest, seeded_exponential

from serving import TINY_FLAGS, Server

SCHEMA = Grammar("json_schema", json.dumps({"type": "object"}))
NOTE = {
    "type": "object",
    "properties": {"note": {"type": "string"}},
    "required": ["note"],
    "additionalProperties": False,
}


def _ids(bits: torch.Tensor) -> list[int]:
    """The token ids of one bitmask row."""
    words = bits.numpy().view(np.uint32)
    return [32 * w + b for w in range(len(words)) for b in range(32) if (words[w] >> b) & 1]


def _mask(allowed: dict[int, list[int]], rows: int, vocab: int) -> torch.Tensor:
    out = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)
    for r, ids in allowed.items():
        out[r] = token_bitmask(ids, vocab)
    return out


# A made-up vocabulary of 70 tokens.
VOCAB = 70
TEXTS = [b"x%d" % i for i in range(VOCAB)]
EOS, QUOTE, BRACKET, BRACE, QUOTE_BRACE, BRACES, COMMA, SPACE, LETTER = 2, 3, 4, 5, 6, 7, 8, 9, 10
for _i, _t in ((EOS, b"<eos>"), (QUOTE, b'"'), (BRACKET, b"]"), (BRACE, b"}"), (QUOTE_BRACE, b'"}'),
               (BRACES, b"}}"), (COMMA, b","), (SPACE, b" "), (LETTER, b"a")):  # fmt: skip
    TEXTS[_i] = _t


def _row(generated: int, max_tokens: int = 100, grammar: Grammar | None = SCHEMA, **kw):
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar, **kw)
    return SampleRequest(p, generated, [], 0)


# ---------------------------------------------------------------- the closing set


def test_closing_tokens_are_made_only_of_quotes_and_closing_brackets_and_blanks_of_space():
    for text in (b'"', b"]", b"}", b'"}', b'"]', b"]}", b"}}", b'"]]', b'""', b'}"', b" }",
                 b' "', b' ""', b"{}", b" []", b" {}"):  # fmt: skip
        assert is_closing(text), text
    for text in (b" ", b"\n\t  ", b"\r\n"):
        assert is_blank(text), text
    for text in (b"", b" ,", b"\n}", b"a", b"\xc2\xa0"):  # (no-break space: not JSON's)
        assert not is_blank(text), text
    for text in (b"", b" ", b"\n", b'" ', b'  "', b"\n}", b"}\n", b'",', b"},", b"{", b"[",
                 b"[[]", b"[]]", b"a", b'"a'):  # fmt: skip
        assert not is_closing(text), text
    vocab = [b"{", b'"', b" ", b'"}', b"<eos>", b"]\n", b"]", b"x"]
    assert closing_token_ids(vocab, [4, 99]) == [1, 3, 4, 6]  # stop ids too, in range


def test_inside_a_string_only_a_quote_first_token_ends_it():
    for text in (b'"', b'"}', b'"]', b'"]}', b'"}}'):
        assert ends_string(text), text
    for text in (b"", b"}", b"]", b"}}", b'}"', b'""', b'" ', b'",', b'"a'):
        assert not ends_string(text), text
    assert string_closing_token_ids(TEXTS) == [QUOTE, QUOTE_BRACE]
    assert bracket_ids(TEXTS) == (BRACKET, BRACE)
    assert bracket_ids([b"]", b"x"]) is None


def test_the_default_models_closing_set_has_the_closers_and_no_whitespace(default_model):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[2])
    ids = closing_token_ids(info.decoded_vocab, info.stop_token_ids)
    texts = {tok.convert_ids_to_tokens(i): i for i in ids}
    assert {'"', "]", "}", '"}', '"]'} <= set(texts)
    assert 2 in ids  # the end of the sequence: a complete JSON ends
    assert {" []", "{}"} <= {tok.decode([i]) for i in ids}
    assert all(is_closing(bytes(info.decoded_vocab[i])) for i in ids if i != 2)
    assert 5 <= len(ids) < 64  # a handful, not the vocabulary


def test_token_bitmask_sets_exactly_its_ids():
    bits = token_bitmask([0, 31, 32, 69, 500], 70)  # 500: outside the vocabulary
    assert bits.dtype == torch.int32 and bits.shape == (3,)
    assert _ids(bits) == [0, 31, 32, 69]


def test_the_window_comes_from_the_environment(monkeypatch):
    for text, want in (("", DEFAULT_WINDOW), ("0", 0), ("48", 48), ("-1", DEFAULT_WINDOW),
                       ("x", DEFAULT_WINDOW)):  # fmt: skip
        monkeypatch.setenv(WINDOW_ENV, text)
        assert window_from_env() == want, text


# ---------------------------------------------------------------- which rows


def test_a_row_is_in_its_window_only_in_its_last_tokens_of_a_json_grammar():
    def p(**kw) -> SamplingParams:
        return SamplingParams(max_tokens=100, **{"grammar": SCHEMA, **kw})

    assert not in_window(p(), 67, 32) and in_window(p(), 68, 32) and in_window(p(), 99, 32)
    assert in_window(p(grammar=Grammar("json_object")), 90, 32)
    assert in_window(p(grammar=Grammar("json_schema", "{}", compact=True)), 90, 32)
    assert not in_window(p(), 99, 0)  # the feature off
    assert not in_window(p(grammar=None), 99, 32)
    assert not in_window(p(grammar=Grammar("regex", "a+")), 99, 32)
    assert not in_window(p(grammar=Grammar("json_schema", "{}", think="open")), 99, 32)
    assert not in_window(p(ignore_eos=True), 99, 32)  # exactly max_tokens asked
    assert not in_window(p(min_tokens=95), 90, 32) and in_window(p(min_tokens=95), 95, 32)


# ---------------------------------------------------------------- the narrowing


def _closing(window: int = 10) -> ClosingSet:
    return ClosingSet.of_vocab(TEXTS, [EOS], VOCAB, window)


def test_narrowing_keeps_the_intersection_else_the_grammars_mask_and_skips_other_rows():
    closing = _closing()
    allowed = {
        0: [COMMA, BRACE, SPACE],  # after a value in an object: "}" closes it
        1: [QUOTE, SPACE],  # a key must come: the quote that opens it
        2: [COMMA, SPACE],  # a comma must come: no closing token, no whitespace
        3: [QUOTE, BRACKET, BRACE, QUOTE_BRACE, BRACES, LETTER, SPACE],  # inside a string
        4: [EOS],  # complete: it ends
        5: [COMMA, BRACE, SPACE],  # the same as row 0, outside its window
        6: [SPACE],  # nothing but whitespace: the grammar's mask as it is
    }
    bitmask = _mask(allowed, 8, VOCAB)
    before = bitmask.clone()
    rows = [_row(95), _row(95), _row(95), _row(99), _row(91), _row(80), _row(99)]
    rows.append(_row(99, grammar=None))
    closing.apply(bitmask, list(allowed), rows)
    assert _ids(bitmask[0]) == [BRACE]
    assert _ids(bitmask[1]) == [QUOTE]
    assert _ids(bitmask[2]) == [COMMA]
    assert _ids(bitmask[3]) == [QUOTE, QUOTE_BRACE]  # "}" and "}}" would be text, not closing
    assert _ids(bitmask[4]) == [EOS]
    assert torch.equal(bitmask[5], before[5])  # outside its window: untouched
    assert torch.equal(bitmask[6], before[6])
    assert torch.equal(bitmask[7], before[7])  # not a masked row


def test_a_rows_narrowing_does_not_depend_on_the_rest_of_the_batch():
    closing = _closing()
    allowed = {0: [COMMA, BRACE], 1: [COMMA, SPACE], 2: [QUOTE, BRACKET, BRACE, LETTER]}
    rows = [_row(95), _row(99), _row(91)]
    together = _mask(allowed, 3, VOCAB)
    closing.apply(together, [0, 1, 2], rows)
    for r in range(3):
        alone = _mask({0: allowed[r]}, 1, VOCAB)
        closing.apply(alone, [0], [rows[r]])
        assert torch.equal(alone[0], together[r]), r


def test_the_sampler_picks_a_closing_token_in_the_window_and_nothing_changes_outside():
    """Greedy: in its window a row takes the best closing token its grammar allows, not its
    best token; rows outside their window (or under ignore_eos), and every row of a mask
    without a closing set, sample exactly what they did."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[:, SPACE] = 10.0  # every row's favourite, never closing
    ok = [COMMA, BRACE, BRACES, SPACE]
    allowed = {0: ok, 1: ok, 2: [COMMA, SPACE], 3: ok}
    rows = [_row(95), _row(20), _row(95), _row(95, ignore_eos=True)]
    masked = [0, 1, 2, 3]
    cpu = torch.device("cpu")
    plain = Sampler(cpu)(logits, rows, TokenMask(_mask(allowed, 4, VOCAB), masked))
    got = Sampler(cpu)(logits, rows, TokenMask(_mask(allowed, 4, VOCAB), masked, None, _closing()))
    assert plain.tokens.tolist() == [SPACE] * 4
    best = BRACE if logits[0, BRACE] > logits[0, BRACES] else BRACES
    assert got.tokens.tolist() == [best, SPACE, COMMA, SPACE]  # row 2: not the whitespace


def test_a_masked_token_is_never_sampled_where_the_seeded_noise_was_zero():
    """seed 0's noise at its 137th token, index 29332, was -log(1.0) = -0 in float32: the
    race divided 0 by 0 and sampled that token though the grammar forbade it."""
    noise = seeded_exponential(torch.tensor([0]), torch.tensor([136]), 49152)
    assert noise[0, 29332] > 0 and bool((noise > 0).all())
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(0))
    mask = TokenMask(_mask({0: [5, 6, 7]}, 1, 49152), [0])
    p = SamplingParams(max_tokens=256, temperature=0.8, seed=0)
    assert int(
        Sampler(torch.device("cpu"))(logits, [SampleRequest(p, 136, [], 0)], mask).tokens[0]
    ) in (5, 6, 7)


# ---------------------------------------------------------------- with xgrammar's masks


def test_a_string_in_its_window_may_only_close(default_model):
    """A real grammar inside a free-form string: outside the window nearly any token; in
    it only tokens that end the string (and close the object), so the JSON ends."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    grammars = Grammars(default_model, len(tok), [2], torch.device("cpu"), 2, closing_window=8)
    grammars.add(1, Grammar("json_schema", json.dumps(NOTE)))
    for t in tok.encode('{"note": "hello world', add_special_tokens=False):
        grammars.prepare([1]).accept([t])
    step = grammars.prepare([1])
    free = _ids(step.mask.bitmask[0].clone())
    assert len(free) > 10_000  # inside a string: almost anything
    step.mask.apply(torch.zeros(1, len(tok)), [_row(92, grammar=Grammar("json_schema", "{}"))])
    closing = [tok.decode([i]) for i in _ids(step.mask.bitmask[0])]
    assert '"' in closing and '"}' in closing
    assert all(text[0] == '"' and set(text) <= set('"]}') for text in closing), closing
    grammars.close()


# ---------------------------------------------------------------- end to end


def _complete(url: str, seed: int, max_tokens: int) -> dict:
    body = {
        "model": "tiny",
        "prompt": "Write a note.",
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "structured_outputs": {"json": NOTE, "disable_any_whitespace": True},
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    return {**out["choices"][0], "tokens": out["usage"]["completion_tokens"]}


def _validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), NOTE)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


SEEDS = range(6)
MAX_TOKENS = DEFAULT_WINDOW + 8  # 8 tokens of free string, then the window


@pytest.fixture(scope="module")
def tiny_url(servers, tiny_models) -> str:
    return servers.get(tiny_models["llama"], *TINY_FLAGS).url


def test_a_random_models_free_strings_close_and_validate(tiny_url):
    """A random-weight model writes a free-form string until something stops it: at
    temperature 1.0 it closes it by chance rarely. Every answer validates and ends on
    "stop"; most ran into their window, so the window is what closed them."""
    outs = [_complete(tiny_url, seed, MAX_TOKENS) for seed in SEEDS]
    for o in outs:
        assert o["finish_reason"] == "stop" and _validates(o["text"]), o
        assert o["tokens"] <= MAX_TOKENS
    in_window_end = [o for o in outs if o["tokens"] > MAX_TOKENS - DEFAULT_WINDOW]
    assert len(in_window_end) >= len(outs) // 2, [o["tokens"] for o in outs]
    short = _complete(tiny_url, 0, 12)  # the whole answer in the window: the shortest JSON
    assert short["finish_reason"] == "stop" and _validates(short["text"]), short


def test_without_the_window_the_same_strings_run_to_max_tokens(tiny_models, monkeypatch):
    """The control: the feature off (`SUBWAY_JSON_CLOSING_WINDOW=0`), the same requests
    mostly end on "length", cut inside their string."""
    monkeypatch.setenv(WINDOW_ENV, "0")
    with Server(tiny_models["llama"], *TINY_FLAGS) as server:
        outs = [_complete(server.url, seed, MAX_TOKENS) for seed in SEEDS]
    cut = [o for o in outs if o["finish_reason"] == "length" and not _validates(o["text"])]
    assert len(cut) >= len(outs) // 2, outs


def test_the_bench_reports_each_schema(tiny_url, capsys):
    from subway.tools.bench import bench_json_validity

    bench_json_validity.main(
        [
            "--url",
            tiny_url,
            "--requests",
            "2",
            "--concurrency",
            "2",
            "--max-tokens",
            "16",
            "--schemas",
            "person,team",
        ]  # fmt: skip
    )
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    rows = {line[0]: line[1:] for line in lines if line and line[0] in ("person", "team")}
    assert set(rows) == {"person", "team"} and all(r[0] == "2" for r in rows.values()), out
