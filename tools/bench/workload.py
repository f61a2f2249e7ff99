"""Seeded synthetic chat workloads, saved as JSONL so that every system runs the identical requests.

Prompts are English-looking text built from a fixed vocabulary, cut to a target length
measured with the model's tokenizer. Target prompt lengths are log-normal (long-tailed),
rescaled so that their mean is `mean_prompt_tokens`, and clipped; output lengths are
log-uniform. Requests are meant to be sent with `ignore_eos` so that each produces
exactly `max_tokens` tokens.

Arrivals: `rate=inf` puts every arrival at 0 s; a finite rate draws Poisson arrivals;
`users=N` gives each request a `user` in 0..N-1, and the client runs one closed loop per
user (each user sends its next request when its last one ends).

    python -m subway.tools.bench.workload --num-requests 64 --seed 0 --rate inf --out wl.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no will
can more other time people year way day man thing woman life child world school state family
student group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot right
study book eye job word business issue side kind head house service friend father power hour
game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party
result change morning reason research girl guy moment air teacher force education good new
first last long great little own old big high different small large next early young
important few public bad same able know get make go see think come take want look use find
give tell ask seem feel try leave call keep let begin help talk turn start show hear play run
move like live believe hold bring happen write provide sit stand lose pay meet include
continue learn lead understand watch follow stop create speak read allow add spend grow open
walk win offer remember love consider appear buy wait serve die send expect build stay fall
cut reach kill remain suggest raise pass sell require report decide pull explain develop
carry train station river mountain garden kitchen window letter music paper table language
""".split()

QUESTIONS = (
    "Please summarize the following notes in a few sentences.",
    "Read the text below and answer: what is the main idea?",
    "Rewrite the following paragraph in a clearer style.",
    "Can you explain what this passage is about?",
    "List the key points of the text that follows.",
    "Translate the tone of this message into something more formal.",
    "What questions would a reader have after reading this?",
    "Continue the story below for a while.",
)


@dataclasses.dataclass
class Request:
    id: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float = 0.0
    priority: int | None = None
    slo_class: str | None = None
    slo_ttft_ms: float | None = None
    user: int | None = None
    model: str | None = None  # the model (a LoRA adapter, say) it names; None: the server's

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Request:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def save_jsonl(requests: Iterable[Request], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")


def load_jsonl(path: str, limit: int = 0) -> list[Request]:
    out: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(Request.from_dict(json.loads(line)))
            if limit and len(out) >= limit:
                break
    return out


def prompt_lengths(
    rng: np.random.Generator, n: int, mean: float, sigma: float, lo: int, hi: int
) -> np.ndarray:
    """Log-normal lengths clipped to [lo, hi], scaled so that the clipped mean is close to `mean`."""
    raw = rng.lognormal(0.0, sigma, n)
    scale = mean / raw.mean()
    for _ in range(20):  # clipping moves the mean; a few fixed-point steps bring it back
        got = np.clip(raw * scale, lo, hi).mean()
        if abs(got - mean) < 0.5:
            break
        scale *= mean / got
    return np.clip(np.rint(raw * scale), lo, hi).astype(int)


def output_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(np.exp(rng.uniform(math.log(lo), math.log(hi), n))), lo, hi).astype(int)


class TextBuilder:
    """Builds prompts of an exact token count from words whose token costs are known.

    The tokenizers of the Llama family pre-split on spaces and punctuation, so the count
    of a text is the sum of the counts of its pieces; the final count is measured anyway.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        pieces = [" " + w for w in WORDS] + [" " + w.capitalize() for w in WORDS] + [".", "\n\n"]
        self.cost = {p: len(tokenizer.encode(p, add_special_tokens=False)) for p in pieces}
        self.fillers = [p for p in pieces[: len(WORDS)] if self.cost[p] == 1]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text))

    def build(self, rng: np.random.Generator, target: int) -> tuple[str, int]:
        head = QUESTIONS[int(rng.integers(len(QUESTIONS)))] + "\n\n"
        parts, used = [head], self.count(head)
        sentence_left = 0
        while True:
            if sentence_left == 0:
                word = " " + WORDS[int(rng.integers(len(WORDS)))].capitalize()
                sentence_left = int(rng.integers(6, 18))
            else:
                word = " " + WORDS[int(rng.integers(len(WORDS)))]
            sentence_left -= 1
            piece = word + "." if sentence_left == 0 else word
            c = self.cost[word] + (self.cost["."] if sentence_left == 0 else 0)
            if used + c > target:
                break
            parts.append(piece)
            used += c
        while used < target and self.fillers:  # top up with one-token words to hit the target
            parts.append(self.fillers[int(rng.integers(len(self.fillers)))])
            used += 1
        text = "".join(parts)
        return text, self.count(text)


def generate(
    tokenizer: Any,
    num_requests: int = 64,
    seed: int = 0,
    rate: float = math.inf,
    users: int = 0,
    mean_prompt_tokens: float = 156.0,
    prompt_sigma: float = 0.9,
    min_prompt_tokens: int = 16,
    max_prompt_tokens: int = 1024,
    min_output_tokens: int = 16,
    max_output_tokens: int = 256,
    interactive_frac: float = 0.0,
    interactive_ttft_ms: float = 1000.0,
) -> list[Request]:
    """The workload for a seed. The defaults give the standard workload (64 requests, ~10k prompt tokens)."""
    rng = np.random.default_rng(seed)
    p_len = prompt_lengths(
        rng, num_requests, mean_prompt_tokens, prompt_sigma, min_prompt_tokens, max_prompt_tokens
    )
    o_len = output_lengths(rng, num_requests, min_output_tokens, max_output_tokens)
    if math.isinf(rate) or rate <= 0 or users > 0:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
        arrivals -= arrivals[0]
    classes = rng.random(num_requests) < interactive_frac
    builder = TextBuilder(tokenizer)
    out = []
    for i in range(num_requests):
        text, n = builder.build(rng, int(p_len[i]))
        r = Request(f"req-{i:05d}", text, n, int(o_len[i]), round(float(arrivals[i]), 6))
        if interactive_frac > 0:
            inter = bool(classes[i])
            r.slo_class = "interactive" if inter else "batch"
            r.priority = 0 if inter else 1
            r.slo_ttft_ms = interactive_ttft_ms if inter else None
        if users > 0:
            r.user = i % users
        out.append(r)
    return out


def load_tokenizer(path: str = "") -> Any:
    from transformers import AutoTokenizer

    if not path:
        from subway.worker.default_model import ensure_default_model

        path = ensure_default_model(quiet=True)
    return AutoTokenizer.from_pretrained(path)


def summary(requests: list[Request]) -> dict[str, float]:
    p = np.array([r.prompt_tokens for r in requests])
    o = np.array([r.max_tokens for r in requests])
    return {
        "num_requests": len(requests),
        "prompt_tokens_total": int(p.sum()),
        "prompt_tokens_mean": float(p.mean()),
        "prompt_tokens_max": int(p.max()),
        "output_tokens_total": int(o.sum()),
        "output_tokens_mean": float(o.mean()),
        "last_arrival_s": float(max(r.arrival_s for r in requests)),
    }


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    g.add_argument("--users", type=int, default=0, help="closed loop with N concurrent users")
    g.add_argument("--mean-prompt-tokens", type=float, default=156.0)
    g.add_argument("--prompt-sigma", type=float, default=0.9, help="log-normal shape")
    g.add_argument("--min-prompt-tokens", type=int, default=16)
    g.add_argument("--max-prompt-tokens", type=int, default=1024)
    g.add_argument("--min-output-tokens", type=int, default=16)
    g.add_argument("--max-output-tokens", type=int, default=256)
    g.add_argument("--interactive-frac", type=float, default=0.0, help="share with a TTFT SLO")
    g.add_argument("--interactive-ttft-ms", type=float, default=1000.0)
    g.add_argument("--tokenizer", default="", help="folder (default: the default model)")


def workload_from_args(
    a: argparse.Namespace, tokenizer: Any = None, **override: Any
) -> list[Request]:
    kw = dict(
        num_requests=a.num_requests,
        seed=a.seed,
        rate=a.rate,
        users=a.users,
        mean_prompt_tokens=a.mean_prompt_tokens,
        prompt_sigma=a.prompt_sigma,
        min_prompt_tokens=a.min_prompt_tokens,
        max_prompt_tokens=a.max_prompt_tokens,
        min_output_tokens=a.min_output_tokens,
        max_output_tokens=a.max_output_tokens,
        interactive_frac=a.interactive_frac,
        interactive_ttft_ms=a.interactive_ttft_ms,
    )
    kw.update(override)
    return generate(tokenizer or load_tokenizer(a.tokenizer), **kw)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_workload_args(p)
    p.add_argument("--out", required=True, help="JSONL file")
    a = p.parse_args(argv)
    reqs = workload_from_args(a)
    save_jsonl(reqs, a.out)
    print(json.dumps(summary(reqs)))


if __name__ == "__main__":
    main()
