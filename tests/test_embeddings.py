"""`/v1/embeddings` and `/v1/score`: pooled final hidden states from the serving engine.

The worker's pooling (`worker/pooling.py`) picks the right rows of each chunk, sums
a mean across chunks, starts again after a preemption and refuses a gap. End to end
on the default model, the vectors equal `transformers`' (cosine >= 0.9999 in float32)
for last and mean pooling, alone, batched, chunked (a prompt longer than the step's
token budget) and beside generation, whose greedy output they leave unchanged; the
official `openai` client reads them (it asks base64); scores are the vectors' cosines;
bad input is a 4xx.
"""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import openai
import pytest
import torch

from subway.ipc.messages import SamplingParams, SeqStep
from subway.scheduler.checks import check_sampling
from subway.worker.pooling import PoolingTracker

from serving import DEFAULT_FLAGS

TEXTS = [
    "The cat sat on the mat.",
    "Interest rates rose again this quarter, and the markets fell.",
    "def add(a, b):\n    return a + b",
]
LONG = " ".join(f"item {i} of a long list that keeps going" for i in range(90))  # > 512 tokens


# ---------------------------------------------------------------- the worker's pooling


def tracker(mode: str, prompt_len: int) -> PoolingTracker:
    t = PoolingTracker()
    t.add(7, SamplingParams(max_tokens=1, pooling=mode), prompt_len)
    t.add(8, SamplingParams(max_tokens=1), prompt_len)  # a plain prompt: not pooled
    return t


def run_chunk(t: PoolingTracker, hidden: torch.Tensor, lo: int, hi: int) -> None:
    """One step whose batch is seq 8's 2 tokens, then seq 7's positions lo..hi-1."""
    steps = [SeqStep(8, 0, 2), SeqStep(7, lo, hi - lo)]
    idx, slices = t.rows(steps, np.array([2, hi - lo]))
    rows = torch.cat([torch.zeros(2, hidden.shape[1]), hidden[lo:hi]])[torch.from_numpy(idx)]
    t.record(rows, slices)


def vector(t: PoolingTracker) -> np.ndarray | None:
    out = t.emit([8, 7])
    assert out is not None and out[0] is None
    return None if out[1] is None else np.frombuffer(out[1], dtype="<f4")


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_pooling_across_chunks_is_the_whole_prompts(mode):
    hidden = torch.randn(10, 4)
    t = tracker(mode, 10)
    for lo, hi in ((0, 3), (3, 7), (7, 10)):
        run_chunk(t, hidden, lo, hi)
    want = hidden[-1] if mode == "last" else hidden.mean(0)
    np.testing.assert_allclose(vector(t), want.numpy(), rtol=1e-5, atol=1e-6)
    assert not t.active  # emitted once


def test_a_prefill_again_from_the_start_starts_the_mean_again():
    hidden = torch.randn(6, 4)
    t = tracker("mean", 6)
    run_chunk(t, hidden * 100, 0, 4)  # preempted after this chunk: its sum is dropped
    run_chunk(t, hidden, 0, 3)
    run_chunk(t, hidden, 3, 6)
    np.testing.assert_allclose(vector(t), hidden.mean(0).numpy(), rtol=1e-5, atol=1e-6)


def test_a_mean_with_a_gap_is_no_vector():
    hidden = torch.randn(6, 4)
    t = tracker("mean", 6)
    run_chunk(t, hidden, 0, 2)
    run_chunk(t, hidden, 3, 6)  # position 2 never ran (a prefix served from a cache)
    assert vector(t) is None


def test_the_scheduler_refuses_a_pooling_it_cannot_run():
    assert check_sampling(SamplingParams(max_tokens=1, pooling="mean"), 100) is None
    assert check_sampling(SamplingParams(max_tokens=1, pooling="cls"), 100) is not None
    assert check_sampling(SamplingParams(max_tokens=2, pooling="last"), 100) is not None


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def server(servers, default_model):
    return servers.get(default_model, *DEFAULT_FLAGS)


@pytest.fixture(scope="module")
def reference(default_model):
    """transformers' pooled, normalised vectors of a text: {(text, mode): vector}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    out = {}
    for text in [*TEXTS, LONG]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            h = model(ids, output_hidden_states=True).hidden_states[-1][0]
        for mode, v in (("last", h[-1]), ("mean", h.mean(0))):
            out[text, mode] = (v / v.norm()).numpy()
    return out


def embed(url: str, inputs, **fields) -> list[np.ndarray]:
    r = httpx.post(url + "/v1/embeddings", json={"model": "m", "input": inputs, **fields},
                   timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [np.array(d["embedding"], dtype=np.float32) for d in body["data"]]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_vectors_equal_transformers_alone_batched_and_chunked(server, reference, mode):
    for text in TEXTS:
        (alone,) = embed(server.url, text, pooling=mode)
        assert cosine(alone, reference[text, mode]) >= 0.9999
    batched = embed(server.url, [*TEXTS, LONG], pooling=mode)
    for text, v in zip([*TEXTS, LONG], batched, strict=True):
        assert cosine(v, reference[text, mode]) >= 0.9999, text[:20]
        assert abs(np.linalg.norm(v) - 1) < 1e-4


def test_the_openai_client_reads_them(server, reference):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        out = client.embeddings.create(model="m", input=TEXTS)  # base64 on the wire
    assert out.usage.prompt_tokens == out.usage.total_tokens > len(TEXTS)
    for text, d in zip(TEXTS, out.data, strict=True):
        assert cosine(np.array(d.embedding), reference[text, "last"]) >= 0.9999


def test_unnormalised_token_id_input_and_scores(server, default_model):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model)(TEXTS[0]).input_ids
    (raw,) = embed(server.url, ids, normalize=False)
    (unit,) = embed(server.url, TEXTS[0])
    assert np.linalg.norm(raw) > 1.5 and cosine(raw, unit) >= 0.9999
    vectors = embed(server.url, TEXTS)
    r = httpx.post(server.url + "/v1/score",
                   json={"text_1": TEXTS[0], "text_2": TEXTS}, timeout=300)  # fmt: skip
    scores = [d["score"] for d in r.json()["data"]]
    want = [cosine(vectors[0], v) for v in vectors]
    np.testing.assert_allclose(scores, want, atol=1e-4)
    assert scores[0] == pytest.approx(1.0, abs=1e-4) and max(scores[1:]) < 0.9999


def test_generation_beside_embeddings_is_unchanged(server, reference):
    chat = {"model": "m", "messages": [{"role": "user", "content": "Tell me about cats."}],
            "max_tokens": 64, "temperature": 0, "ignore_eos": True}  # fmt: skip
    alone = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=300).json()
    pieces: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions",
                          json={**chat, "stream": True}, timeout=300) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(120)
    before = len(pieces)
    vectors = embed(server.url, [LONG, *TEXTS] * 4, pooling="mean")
    reader.join(300)
    assert before < len(pieces)  # the generation went on after the embeddings came
    text = "".join(
        json.loads(p[6:])["choices"][0]["delta"].get("content") or ""
        for p in pieces
        if json.loads(p[6:])["choices"]
    )
    assert text == alone["choices"][0]["message"]["content"]
    for text_, v in zip([LONG, *TEXTS] * 4, vectors, strict=True):
        assert cosine(v, reference[text_, "mean"]) >= 0.9999


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/embeddings", {"input": "x", "dimensions": 8}, 400, "dimensions"),
        ("/v1/embeddings", {"input": []}, 400, "input"),
        ("/v1/embeddings", {"input": 5}, 400, "input"),
        ("/v1/embeddings", {"input": [10**9]}, 400, "input"),
        ("/v1/embeddings", {"input": "x " * 5000}, 400, "input"),
        ("/v1/embeddings", {"input": ["x"] * 65}, 400, "input"),
        ("/v1/embeddings", {"input": "x", "model": "other"}, 404, "model"),
        ("/v1/embeddings", {"input": "x", "pooling": "cls"}, 400, "pooling"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_2"),
        ("/v1/score", {"text_1": "a"}, 400, "text_2"),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_and_the_server_serves_on(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"].startswith(param)
    assert len(embed(server.url, "still here")) == 1
