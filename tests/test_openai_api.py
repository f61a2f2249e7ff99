"""The OpenAI-compatible API of a live `subway serve`, driven by the official `openai` client.

Every sampling and output parameter, streaming and not: shapes, and behaviour
(stops honoured, `n` distinct under temperature and identical under greedy,
seeds reproducible, logprobs consistent with greedy choices and with
`transformers`, usage counts right). One server for the module: the tiny Llama,
with one extra end-of-sequence id, a token the model produces greedily for
`EOS_PROMPT`, so that EOS and `ignore_eos` can be seen.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

from reference import hf_greedy, hf_model, with_early_eos
from serving import KV_BLOCKS, Server

MODEL = "tiny"
EOS_PROMPT = "hello there"
PROMPT = "The quick brown fox"  # greedy output repeats tokens (see test_penalties)
STREAMS = [False, True]


@pytest.fixture(scope="module")
def eos_model(tiny_models, tmp_path_factory):
    """The tiny Llama, plus an EOS id: the 4th greedy token after EOS_PROMPT."""
    dst = str(tmp_path_factory.mktemp("eos") / "llama")
    _, eos, greedy, tok = with_early_eos(tiny_models["llama"], dst, EOS_PROMPT, 6)
    return dst, eos, greedy, tok


@pytest.fixture(scope="module")
def server(eos_model):
    s = Server(eos_model[0], "--served-model-name", MODEL, "--max-model-len", "512", *KV_BLOCKS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tok(eos_model):
    return eos_model[3]


# ---------------------------------------------------------------- helpers

# Parameters beyond OpenAI's (vLLM's extras, Subway's timeout): sent in extra_body.
EXTRA = ("ignore_eos", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "request_timeout")


def _args(kw: dict) -> dict:
    kw = dict(kw)
    kw.setdefault("model", MODEL)
    extra = dict(kw.pop("extra_body", {}))
    for key in EXTRA:
        if key in kw:
            extra["timeout" if key == "request_timeout" else key] = kw.pop(key)
    if extra:
        kw["extra_body"] = extra
    return kw


def _merge_logprobs(into: dict | None, more: dict | None) -> dict | None:
    if more is None:
        return into
    if into is None:
        return {k: list(v) for k, v in more.items()}
    for k, v in more.items():
        into[k] = into[k] + list(v)
    return into


def complete(client: openai.OpenAI, stream: bool, **kw) -> dict:
    """A completion as a dict of the non-streaming shape, however it was asked."""
    kw = _args(kw)
    if not stream:
        return client.completions.create(**kw).model_dump()
    kw["stream_options"] = {"include_usage": True}
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks, "no chunk"
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and chunks[0].id.startswith("cmpl-")
    choices: dict[int, dict] = {}
    for c in chunks:
        assert c.object == "text_completion" and c.model == MODEL and isinstance(c.created, int)
        for ch in c.choices:
            got = choices.setdefault(ch.index, {"index": ch.index, "text": "", "logprobs": None})
            assert "finish_reason" not in got, "a chunk after the choice's finish"
            got["text"] += ch.text
            lp = ch.logprobs.model_dump() if ch.logprobs is not None else None
            got["logprobs"] = _merge_logprobs(got["logprobs"], lp)
            if ch.finish_reason is not None:
                got["finish_reason"] = ch.finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    out = [choices[i] for i in sorted(choices)]
    assert all("finish_reason" in c for c in out)
    return {"id": last.id, "choices": out, "usage": last.usage.model_dump()}


def chat(client: openai.OpenAI, stream: bool, **kw) -> dict:
    kw = _args(kw)
    kw.setdefault("messages", [{"role": "user", "content": "Hi there"}])
    if not stream:
        out = client.chat.completions.create(**kw).model_dump()
        for ch in out["choices"]:
            assert ch["message"]["role"] == "assistant"
        return out
    kw["stream_options"] = {"include_usage": True}
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    choices: dict[int, dict] = {}
    for c in chunks:
        assert c.object == "chat.completion.chunk" and c.model == MODEL
        for ch in c.choices:
            if ch.index not in choices:  # a choice's first chunk: the role, no content yet
                assert ch.delta.role == "assistant" and not ch.delta.content
                choices[ch.index] = {"index": ch.index, "content": "", "logprobs": None}
                continue
            got = choices[ch.index]
            assert "finish_reason" not in got
            got["content"] += ch.delta.content or ""
            if ch.logprobs is not None:
                got["logprobs"] = got["logprobs"] or {"content": []}
                got["logprobs"]["content"] += ch.logprobs.model_dump()["content"]
            if ch.finish_reason is not None:
                got["finish_reason"] = ch.finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    out = []
    for i in sorted(choices):
        c = choices[i]
        out.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": c["content"]},
                "logprobs": c["logprobs"],
                "finish_reason": c["finish_reason"],
            }
        )
    return {"choices": out, "usage": last.usage.model_dump()}


def texts(out: dict) -> list[str]:
    if "message" in out["choices"][0]:
        return [c["message"]["content"] for c in out["choices"]]
    return [c["text"] for c in out["choices"]]


def greedy_ids(eos_model, prompt: str, n: int) -> list[int]:
    path, _, _, tok = eos_model
    return hf_greedy(path, tok.encode(prompt, add_special_tokens=True), n).tokens


# ---------------------------------------------------------------- plain routes


def test_models_health_version_tokenize(server, client, tok):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    ids = tok.encode(PROMPT, add_special_tokens=True)
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 512
    r = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert r["prompt"] == PROMPT
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r["tokens"] == tok.encode(text, add_special_tokens=False)


def test_raw_response_shapes(server):
    """Faithful objects, without `system_fingerprint`."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body).json()
    assert set(r) == {"id", "object", "created", "model", "choices", "usage"}
    assert set(r["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert set(r["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body).json()
    assert set(r) == {"id", "object", "created", "model", "choices", "usage"}
    assert r["object"] == "chat.completion"
    assert set(r["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    body["stream"] = True
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events and all("system_fingerprint" not in e for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- lengths, usage, EOS


@pytest.mark.parametrize("stream", STREAMS)
def test_max_tokens_usage_and_streaming_equals_non_streaming(client, tok, eos_model, stream):
    prompt_ids = tok.encode(PROMPT, add_special_tokens=True)
    out = complete(client, stream, prompt=PROMPT, max_tokens=7, temperature=0, ignore_eos=True)
    [c] = out["choices"]
    assert c["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids) and usage["completion_tokens"] == 7
    assert usage["total_tokens"] == len(prompt_ids) + 7
    assert c["text"] == tok.decode(greedy_ids(eos_model, PROMPT, 7))
    out = chat(client, stream, max_completion_tokens=5, temperature=0, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    out2 = chat(client, stream, max_tokens=5, temperature=0, ignore_eos=True)
    assert texts(out2) == texts(out)


@pytest.mark.parametrize("stream", STREAMS)
def test_eos_stops_unless_ignore_eos(client, eos_model, stream):
    _, eos, greedy, tok = eos_model
    out = complete(client, stream, prompt=EOS_PROMPT, max_tokens=10, temperature=0)
    [c] = out["choices"]
    assert c["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 4  # the EOS token counts...
    assert c["text"] == tok.decode(greedy[:3])  # ...but shows no text
    out = complete(client, stream, prompt=EOS_PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    [c] = out["choices"]
    assert c["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 10
    assert c["text"].startswith(tok.decode(greedy[:3]))


# ---------------------------------------------------------------- stops


@pytest.mark.parametrize("stream", STREAMS)
def test_stop_strings_and_stop_token_ids(client, eos_model, stream):
    tok = eos_model[3]
    ids = greedy_ids(eos_model, PROMPT, 12)
    full = tok.decode(ids)
    cut = tok.decode(ids[:5])
    stop = tok.decode(ids[5:7])
    assert stop.strip() and full.find(stop) == len(cut), "pick a stop that first occurs there"
    for stops in (stop, [stop], ["never-there", stop]):
        out = complete(
            client, stream, prompt=PROMPT, max_tokens=12, temperature=0, stop=stops,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        [c] = out["choices"]
        assert c["text"] == cut and c["finish_reason"] == "stop", stops
    # A token id that stops: it counts as output, its text does not show.
    stop_id = ids[4]
    assert stop_id not in ids[:4]
    out = complete(
        client, stream, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )  # fmt: skip
    [c] = out["choices"]
    assert c["finish_reason"] == "stop" and c["text"] == tok.decode(ids[:4])
    assert out["usage"]["completion_tokens"] == 5
    # Chat honours them too.
    out = chat(client, stream, max_tokens=12, temperature=0, ignore_eos=True)
    content = texts(out)[0]
    assert len(content) > 4
    stop = content[2:4]
    out = chat(client, stream, max_tokens=12, temperature=0, stop=[stop], ignore_eos=True)
    assert texts(out)[0] == content[: content.find(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------- n, seeds, sampling


@pytest.mark.parametrize("stream", STREAMS)
def test_n_distinct_under_temperature_identical_under_greedy(client, stream):
    out = complete(
        client, stream, prompt=PROMPT, max_tokens=6, n=4, temperature=1.0, ignore_eos=True
    )
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert len(set(texts(out))) == 4
    assert out["usage"]["completion_tokens"] == 24
    out = complete(
        client, stream, prompt=PROMPT, max_tokens=6, n=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(set(texts(out))) == 1
    out = chat(client, stream, max_tokens=6, n=3, temperature=1.0, ignore_eos=True)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and len(set(texts(out))) == 3
    out = chat(client, stream, max_tokens=6, n=3, temperature=0, ignore_eos=True)
    assert len(set(texts(out))) == 1


@pytest.mark.parametrize("stream", STREAMS)
def test_seeds_reproducible_whatever_the_batch(server, client, stream):
    args = dict(prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    a = texts(complete(client, stream, seed=1234, **args))
    b = texts(complete(client, stream, seed=1234, **args))
    c = texts(complete(client, stream, seed=4321, **args))
    assert a == b and a != c
    # n choices of a seeded request differ from each other, and reproduce.
    n1 = texts(complete(client, stream, seed=7, n=3, **args))
    n2 = texts(complete(client, stream, seed=7, n=3, **args))
    assert n1 == n2 and len(set(n1)) == 3
    # The same seeded request amid other traffic: the same tokens.
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    async def crowd() -> list[str]:
        noise = [
            aclient.completions.create(
                **_args(
                    dict(
                        prompt=f"noise {i} " * (i + 1),
                        max_tokens=12,
                        temperature=0.9 if i % 2 else 0.0,
                        top_k=40 if i % 3 else -1,
                        ignore_eos=True,
                    )
                )
            )
            for i in range(6)
        ]
        seeded = aclient.completions.create(**_args(dict(seed=1234, **args)))
        results = await asyncio.gather(seeded, *noise)
        await aclient.close()
        return [results[0].choices[0].text]

    assert asyncio.run(crowd()) == a


@pytest.mark.parametrize("stream", STREAMS)
def test_truncation_parameters_reach_the_sampler(client, eos_model, stream):
    """top_k=1, a tiny top_p and min_p=1 all leave only the greedy token."""
    tok = eos_model[3]
    greedy = tok.decode(greedy_ids(eos_model, PROMPT, 8))
    base = dict(prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3)
    for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        out = complete(client, stream, **base, extra_body={"ignore_eos": True, **extra})
        assert texts(out) == [greedy], extra
    hot = complete(client, stream, **base, extra_body={"ignore_eos": True, "top_k": 50})
    assert texts(hot) != [greedy]
    out = chat(client, stream, max_tokens=6, temperature=2.0, top_p=1e-6, ignore_eos=True)
    greedy_chat = chat(client, stream, max_tokens=6, temperature=0, ignore_eos=True)
    assert texts(out) == texts(greedy_chat)


@pytest.mark.parametrize("stream", STREAMS)
def test_penalties(client, tok, stream):
    def ids_of(out: dict) -> list[int]:
        return tok.encode(texts(out)[0], add_special_tokens=False)

    base = dict(prompt=PROMPT, max_tokens=16, temperature=0)
    plain = complete(client, stream, **base, extra_body={"ignore_eos": True})
    plain_ids = ids_of(plain)
    assert len(set(plain_ids)) < len(plain_ids), "this prompt repeats under greedy"
    prompt_ids = set(tok.encode(PROMPT, add_special_tokens=False))
    for kw in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 100.0}},
    ):
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        out = complete(client, stream, **base, **kw, extra_body=extra)
        got = ids_of(out)
        assert texts(out) != texts(plain), kw
        assert len(set(got)) == len(got), (kw, got)
        if "repetition_penalty" in extra:
            assert not prompt_ids & set(got)  # it counts the prompt too
    out = chat(client, stream, max_tokens=12, temperature=0, frequency_penalty=2.0, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 12


# ---------------------------------------------------------------- logprobs


def _check_completion_logprobs(lp: dict, text: str, k: int, greedy: bool) -> None:
    n = len(lp["tokens"])
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == text
    offset = lp["text_offset"][0]
    for token, value, top, off in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"], strict=True
    ):
        assert off == offset
        offset += len(token)
        assert value <= 0.0 and token in top and top[token] == pytest.approx(value)
        assert k <= len(top) <= k + 1
        if greedy:
            assert value == pytest.approx(max(top.values()), abs=1e-5)


@pytest.mark.parametrize("stream", STREAMS)
def test_completion_logprobs_and_echo(client, eos_model, stream):
    path, _, _, tok = eos_model
    out = complete(
        client, stream, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    [c] = out["choices"]
    _check_completion_logprobs(c["logprobs"], c["text"], 3, greedy=True)
    assert c["logprobs"]["text_offset"][0] == 0
    # logprobs=0: the chosen token's alone.
    out = complete(client, stream, prompt=PROMPT, max_tokens=3, temperature=0.8, logprobs=0, seed=1)
    _check_completion_logprobs(out["choices"][0]["logprobs"], out["choices"][0]["text"], 0, False)
    # echo: the prompt first, in the text and in the logprobs (its first token's null).
    prompt_ids = tok.encode(PROMPT, add_special_tokens=True)
    out = complete(
        client, stream, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    [c] = out["choices"]
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(prompt_ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][: len(prompt_ids)][0] == 0
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt_ids])).logits[0].log_softmax(-1)
    for j in range(1, len(prompt_ids)):
        assert lp["token_logprobs"][j] == pytest.approx(float(ref[j - 1, prompt_ids[j]]), abs=1e-4)
        assert len(lp["top_logprobs"][j]) >= 2
    gen = {k: v[len(prompt_ids) :] for k, v in lp.items()}
    _check_completion_logprobs(gen, c["text"][len(PROMPT) :], 2, greedy=True)
    assert out["usage"]["prompt_tokens"] == len(prompt_ids)
    # echo without logprobs, and max_tokens 0 (the prompt's logprobs alone, as harnesses ask)
    out = complete(client, stream, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert out["choices"][0]["text"].startswith(PROMPT)
    out = complete(client, stream, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    [c] = out["choices"]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(
        lp["token_logprobs"][1 : len(prompt_ids)]
    )


@pytest.mark.parametrize("stream", STREAMS)
def test_chat_logprobs(client, stream):
    out = chat(
        client, stream, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True
    )
    [c] = out["choices"]
    content = c["logprobs"]["content"]
    assert len(content) == 5
    assert "".join(t["token"] for t in content) == c["message"]["content"]
    for t in content:
        assert len(t["top_logprobs"]) == 3
        assert t["top_logprobs"][0]["token"] == t["token"]
        assert t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"])
        assert t["bytes"] == list(t["token"].encode())
    out = chat(client, stream, max_tokens=3, temperature=0, logprobs=True, ignore_eos=True)
    assert all(t["top_logprobs"] == [] for t in out["choices"][0]["logprobs"]["content"])
    out = chat(client, stream, max_tokens=3, temperature=0)
    assert out["choices"][0]["logprobs"] is None


# ---------------------------------------------------------------- prompts, abort


@pytest.mark.parametrize("stream", STREAMS)
def test_token_id_prompts_and_batches(client, tok, stream):
    a, b = PROMPT, "Once upon a time"
    ids_a = tok.encode(a, add_special_tokens=True)
    args = dict(max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text_a = texts(complete(client, stream, prompt=a, **args))[0]
    text_b = texts(complete(client, stream, prompt=b, **args))[0]
    assert texts(complete(client, stream, prompt=ids_a, **args)) == [text_a]
    out = complete(client, stream, prompt=[a, b], n=2, **args)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert texts(out) == [text_a, text_a, text_b, text_b]
    ids_b = tok.encode(b, add_special_tokens=True)
    out = complete(client, stream, prompt=[ids_a, ids_b], **args)
    assert texts(out) == [text_a, text_b]
    assert out["usage"]["prompt_tokens"] == len(ids_a) + len(ids_b)
    assert out["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("stream", STREAMS)
def test_finish_reason_abort_on_timeout(client, stream):
    out = complete(
        client, stream, prompt=PROMPT, max_tokens=400, temperature=0,
        ignore_eos=True, request_timeout=0.3,
    )  # fmt: skip
    [c] = out["choices"]
    assert c["finish_reason"] == "abort"
    assert 0 < out["usage"]["completion_tokens"] < 400
    out = chat(client, stream, max_tokens=400, temperature=0, ignore_eos=True, request_timeout=0.3)
    assert out["choices"][0]["finish_reason"] == "abort"


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)


# ---------------------------------------------------------------- the sampler and runner behind them


def _reference_penalties(scores, rows):
    """Row by row, as vLLM defines them."""
    out = scores.clone()
    for i, r in enumerate(rows):
        p = r.params
        row = out[i]
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[torch.tensor(r.tokens, dtype=torch.int64)] = True
        row = torch.where(
            seen,
            torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty),
            row,
        )
        counts = torch.bincount(
            torch.tensor(r.tokens[r.prompt_len :], dtype=torch.int64), minlength=row.shape[0]
        ).float()
        out[i] = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return out


def test_sampler_batches_penalties_and_seeds():
    from subway.ipc.messages import SamplingParams
    from subway.worker.sampler import Sampler, SampleRequest, seeded_exponential

    gen = torch.Generator().manual_seed(0)
    vocab = 300
    logits = torch.randn(6, vocab, generator=gen)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.3, seed=11),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.05),
        SamplingParams(temperature=0.7, top_p=0.8, seed=12, repetition_penalty=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, frequency_penalty=-0.5),
    ]
    rows = [
        SampleRequest(p, i, [int(t) for t in torch.randint(vocab, (5 + 3 * i,), generator=gen)], 4)
        for i, p in enumerate(params)
    ]
    penalised = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0
                 or p.presence_penalty or p.frequency_penalty]  # fmt: skip
    batched = Sampler._apply_penalties(logits.clone(), rows, penalised)
    torch.testing.assert_close(batched, _reference_penalties(logits, rows))
    # A seeded row draws the same token alone, in this batch, or in a reversed batch.
    out = Sampler(torch.device("cpu"), seed=1)(logits, rows).tokens
    for i in (1, 3):
        alone = Sampler(torch.device("cpu"), seed=2)(logits[i : i + 1], [rows[i]]).tokens
        assert alone.tolist() == [out[i].item()]
    rev = Sampler(torch.device("cpu"), seed=3)(logits.flip(0), rows[::-1]).tokens.flip(0)
    assert rev[1] == out[1] and rev[3] == out[3]
    # The noise is a pure function of (seed, counter), Exp(1)-distributed.
    e = seeded_exponential(torch.tensor([5, 5, 6]), torch.tensor([0, 0, 0]), 20_000)
    assert torch.equal(e[0], e[1]) and not torch.equal(e[0], e[2])
    assert abs(float(e.mean()) - 1.0) < 0.03 and float(e.min()) > 0


def test_runner_prompt_logprobs_over_chunks_match_transformers(eos_model):
    from subway.ipc.config import EngineConfig
    from subway.ipc.messages import NewSeq, Plan, SamplingParams, SeqStep, TokenRef
    from subway.worker.runner import ModelRunner

    path = eos_model[0]
    runner = ModelRunner(
        EngineConfig.build(path=path, num_kv_blocks=16, use_shm=False, device="cpu")
    )
    prompt = list(range(300, 340))
    asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    outs = [
        runner.execute(
            Plan(0, [SeqStep(0, 0, 16, [0, 1], sample=False), SeqStep(1, 0, 3, [4])],
                 [NewSeq(0, TokenRef(ids=prompt), asked), NewSeq(1, TokenRef(ids=[5, 6, 7]), plain)])
        ),
        runner.execute(Plan(1, [SeqStep(0, 16, 16, [2], sample=False), SeqStep(1, 3, 1)])),
        runner.execute(Plan(2, [SeqStep(1, 4, 1), SeqStep(0, 32, 8)])),
    ]  # fmt: skip
    assert [o.prompt_logprobs for o in outs[:2]] == [None, None]
    assert outs[2].seq_ids == [1, 0] and outs[2].prompt_logprobs[0] is None
    plp = outs[2].prompt_logprobs[1]
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0].log_softmax(-1)
    want = [float(ref[j, prompt[j + 1]]) for j in range(len(prompt) - 1)]
    assert plp.logprobs == pytest.approx(want, abs=1e-4)
    assert [ids for ids in plp.top_ids] == ref[:-1].topk(2).indices.tolist()
    later = runner.execute(Plan(3, [SeqStep(0, 40, 1)]))
    assert later.prompt_logprobs is None  # once only
