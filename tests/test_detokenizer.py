"""Incremental detokenization and stop strings, with the default model's tokenizer."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from subway.frontend.detokenizer import Detokenizer, IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello, world! How are you today?",
    "héllo wörld — naïve café, déjà vu",
    "emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 in a row",
    "中文字符和日本語のテキスト、한국어도 있어요。",
    "mixed: αβγ δ 🚇 subway ∑∫ √2 ≈ 1.414",
    "  leading spaces\n\ttabs and\nnewlines  ",
    "<|im_start|>user\nspecial tokens inside<|im_end|>",
]

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def stream(tokenizer, ids, stops=(), chunks=None, prompt_ids=()):
    """Feed ids in chunks; returns (pieces, stopped, tokens consumed)."""
    detok = Detokenizer(tokenizer, prompt_ids, stops)
    pieces, consumed, i = [], 0, 0
    rng = random.Random(0)
    while i < len(ids):
        n = chunks or rng.randint(1, 4)
        step = detok.add(ids[i : i + n])
        pieces.append(step.text)
        consumed += step.num_tokens
        if step.stopped:
            return pieces, True, consumed
        i += n
    last = detok.finish()
    pieces.append(last.text)
    return pieces, last.stopped, consumed


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [1, 3, None])
def test_incremental_equals_full_decode(tokenizer, text, chunks):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, stopped, consumed = stream(tokenizer, ids, chunks=chunks)
    assert "".join(pieces) == full_decode(tokenizer, ids)
    assert not stopped and consumed == len(ids)
    assert not any("\ufffd" in p for p in pieces), "a piece split a character"


def test_byte_tokens_hold_back_until_the_character_completes(tokenizer):
    ids = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) >= 2  # byte-level BPE splits the emoji
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == " 😀"


def test_prompt_context_keeps_the_leading_space(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    out = tokenizer.encode(" world", add_special_tokens=False)
    pieces, _, _ = stream(tokenizer, out, chunks=1, prompt_ids=prompt)
    assert "".join(pieces) == " world"


@SETTINGS
@given(text=st.text(min_size=0, max_size=40))
def test_random_text_roundtrips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, _, _ = stream(tokenizer, ids)
    assert "".join(pieces) == full_decode(tokenizer, ids)


@SETTINGS
@given(data=st.data())
def test_random_token_ids_roundtrip(tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=30))
    pieces, _, _ = stream(tokenizer, ids)
    assert "".join(pieces) == full_decode(tokenizer, ids)


def test_stop_string_cut_across_token_boundaries(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in ["k brown f", "ps ov", "y d", "dog", "fox jumps over"]:
        pieces, stopped, consumed = stream(tokenizer, ids, stops=[stop], chunks=1)
        assert stopped
        assert "".join(pieces) == text[: text.index(stop)]
        # Consumed up to the token that completes the stop string, not beyond.
        assert consumed == min(
            k for k in range(len(ids) + 1) if stop in full_decode(tokenizer, ids[:k])
        )


def test_earliest_stop_wins_and_unfinished_stop_is_released(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, stopped, _ = stream(tokenizer, ids, stops=["delta", "beta"])
    assert stopped and "".join(pieces) == "alpha "
    pieces, stopped, _ = stream(tokenizer, ids, stops=["delta epsilon"], chunks=1)
    assert not stopped and "".join(pieces) == text


@SETTINGS
@given(data=st.data())
def test_streamed_pieces_never_contain_part_of_a_stop(tokenizer, data):
    text = data.draw(st.sampled_from(TEXTS[:5]))
    start = data.draw(st.integers(0, len(text) - 2))
    stop = text[start : data.draw(st.integers(start + 1, min(len(text), start + 8)))]
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = text[: text.index(stop)]
    detok = Detokenizer(tokenizer, (), [stop])
    shown = ""
    for i in ids:
        step = detok.add([i])
        shown += step.text
        # Everything shown so far lies before the stop string's first occurrence.
        assert expected.startswith(shown), (shown, stop)
        if step.stopped:
            break
    assert shown == expected


def test_matcher_holds_possible_prefixes():
    m = StopStringMatcher(["abc", "xyz"])
    assert m.feed("12a") == "12"
    assert m.feed("b") == ""
    assert m.feed("d") == "abd"
    assert m.feed("x") == ""
    assert m.feed("yz tail") == "" and m.stopped
    assert m.flush() == ""
    m = StopStringMatcher(["abc"])
    assert m.feed("ab") == "" and m.flush() == "ab"


class CountingTokenizer:
    """The tokenizer, counting the ids handed to `decode`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_skipped_special_tokens_cost_linear_decoding(tokenizer):
    """A model that keeps sampling special tokens (EOS under ignore_eos) must not make
    each step decode a window that grows with every skipped one."""
    counting = CountingTokenizer(tokenizer)
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    detok = Detokenizer(counting, prompt)
    specials = [tokenizer.eos_token_id, *tokenizer.all_special_ids]
    base = counting.decoded  # what setting up cost (the prompt's context, the probe)
    n = 20_000
    for k in range(n):
        assert detok.add([specials[k % len(specials)]]).text == ""
        assert counting.decoded - base < 4 * (k + 1) + 64, f"quadratic after {k + 1} tokens"
    tail = tokenizer.encode(" world", add_special_tokens=False)
    text = detok.add(tail).text + detok.finish().text
    assert text == " world"
    assert counting.decoded - base < 4 * (n + len(tail)) + 64


def test_special_tokens_between_text_decode_as_the_whole(tokenizer):
    ids = tokenizer.encode("one two", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    seq = [eos, ids[0], eos, eos, *tokenizer.all_special_ids, *ids[1:], eos]
    for chunks in (1, 2, None):
        pieces, _, consumed = stream(tokenizer, seq, chunks=chunks)
        assert "".join(pieces) == full_decode(tokenizer, seq) and consumed == len(seq)
    # Kept when not skipped: then they are text like any other.
    detok = Detokenizer(tokenizer, (), (), skip_special_tokens=False)
    text = detok.add(seq).text + detok.finish().text
    assert text == full_decode(tokenizer, seq, skip_special_tokens=False)


def pieces_of(detok: Detokenizer, ids, chunks: int = 1) -> tuple[str, bool, int]:
    """The text a request shows, whether a stop string ended it, and the ids it used."""
    text, used = "", 0
    for k in range(0, len(ids), chunks):
        step = detok.add(ids[k : k + chunks])
        text, used = text + step.text, used + step.num_tokens
        if step.stopped:
            return text, True, used
    last = detok.finish()
    return text + last.text, last.stopped, used


def test_include_stop_keeps_the_stop_string_at_the_end(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in ["k brown f", "ps ov", "dog"]:
        for chunks in (1, 3):
            detok = Detokenizer(tokenizer, (), [stop], include_stop=True)
            shown, stopped, _ = pieces_of(detok, ids, chunks)
            assert stopped and shown == text[: text.index(stop) + len(stop)], (stop, chunks)
    # Two stops at once: the earliest wins, as without include_stop.
    detok = Detokenizer(tokenizer, (), ["lazy", "quick brown"], include_stop=True)
    assert pieces_of(detok, ids)[0] == "The quick brown"


def test_no_stop_string_matches_within_min_tokens(tokenizer):
    text = "one, two, three, four, five, six"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first = next(k for k in range(len(ids) + 1) if "," in full_decode(tokenizer, ids[:k]))
    assert first < len(ids) - 4
    for chunks in (1, 4):
        shown, stopped, used = pieces_of(Detokenizer(tokenizer, (), [","]), ids, chunks)
        assert stopped and shown == "one" and used == first
        detok = Detokenizer(tokenizer, (), [","], min_tokens=first)
        shown, stopped, used = pieces_of(detok, ids, chunks)
        assert stopped and shown == "one, two", (chunks, shown)
        # Past the text: no stop at all, everything shows.
        detok = Detokenizer(tokenizer, (), [","], min_tokens=len(ids))
        assert pieces_of(detok, ids, chunks) == (text, False, len(ids))


def test_a_stop_string_may_start_inside_the_min_tokens(tokenizer):
    """As vLLM: only the text of the first min_tokens tokens is exempt, so a stop that
    ends after it matches even where it begins inside it; what was shown stays shown,
    and nothing after it is."""
    text = "alpha beta gamma delta"
    stop = "a beta g"
    ids = tokenizer.encode(text, add_special_tokens=False)
    k = next(k for k in range(len(ids)) if full_decode(tokenizer, ids[:k]).startswith("alpha b"))
    done = next(j for j in range(len(ids) + 1) if stop in full_decode(tokenizer, ids[:j]))
    assert k < done
    detok = Detokenizer(tokenizer, (), [stop], min_tokens=k)
    assert pieces_of(detok, ids) == (full_decode(tokenizer, ids[:k]), True, done)
