"""Accuracy beside speed: an lm-eval task through `local-completions`, per quantization setting.

For each setting (bfloat16; `--quantization int8`; int8 weights + `--kv-cache-dtype int8`)
a `subway serve` starts on the default model (tools/bench/compare.py's `subway_server`, on
a free port, stopped after), and lm-eval's `local-completions` model scores the local task
`subway_pydoc_lastword` against its `/v1/completions` (token-id prompts, `echo`,
`logprobs: 1`, `max_tokens: 1`: the prompt's logprobs, as loglikelihood tasks need).

The task (tools/bench/lm_eval_tasks/): a sentence of Python's reference documentation
(the one before it in its paragraph as context, when there is one) without its last word,
and four choices: the true last word and three distractors, words of the context first
(the model must know which of the words it just read ends the sentence), then last words
of other sentences where the context has too few. Chance is 25%. The data is committed; `--make-data` regenerates it from this Python's
`pydoc_data/topics.py` (deterministic; the committed file came from Python 3.11.7).

It prints per setting: acc and acc_norm with lm-eval's stderr, n, the wall time, and the
paired difference from bfloat16 over the same examples (mean and its stderr: the
examples that flip, which is what a 1-point budget is about).

    python -m subway.tools.bench.bench_lm_eval [--out docs/bench/lm_eval.json] [--limit N]

All 656 examples, three settings: about 5 minutes on 2 cores (`--threads 1` each server).
Needs `pip install -e ".[bench]"` (lm-eval with its `api` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import re
import statistics
import time
from typing import Any

from subway.tools.bench import compare

TASK = "subway_pydoc_lastword"
TASKS_DIR = pathlib.Path(__file__).resolve().parent / "lm_eval_tasks"
DATA = TASKS_DIR / f"{TASK}.jsonl"
N_CHOICES = 4
SEED = 0
SETTINGS: dict[str, list[str]] = {
    "bfloat16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "int8+kv8": ["--dtype", "bfloat16", "--quantization", "int8", "--kv-cache-dtype", "int8"],
}
# Prose only: no code, markup or ellipses; the last word plain letters before a full stop.
_NOT_PROSE = re.compile(r"[=<>{}\[\]|*#`~\\]|\.\.\.")
_LAST_WORD = re.compile(r"[A-Za-z]{3,}\.")
_SENTENCE_END = re.compile(r"(?<=[a-z][.!?])\s+(?=[A-Z])")


def sentences(topics: dict[str, str]) -> list[tuple[str, str]]:
    """(previous sentence or "", sentence) for every prose sentence, first occurrence only."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            lines = para.split("\n")
            if any(line.startswith(" ") for line in lines):  # code blocks, grammar, tables
                continue
            prev = ""
            for s in _SENTENCE_END.split(" ".join(line.strip() for line in lines)):
                words = s.split()
                s = " ".join(words)
                ok = 8 <= len(words) <= 45 and _LAST_WORD.fullmatch(words[-1]) is not None
                if ok and s[0].isupper() and not _NOT_PROSE.search(s) and s not in seen:
                    seen.add(s)
                    out.append((prev, s))
                prev = s
    return out


def make_examples(topics: dict[str, str], seed: int = SEED) -> list[dict[str, Any]]:
    """The task's rows: context, choices (the true last word among distractors), label."""
    pairs = sentences(topics)
    answers = [s.split()[-1].rstrip(".") for _, s in pairs]
    pool = sorted(set(answers))
    rng = random.Random(seed)
    rows = []
    for i, ((prev, s), answer) in enumerate(zip(pairs, answers, strict=True)):
        context = " ".join([prev, s.rsplit(" ", 1)[0]]).strip()
        # Words of the context first (as LAMBADA's hard cases: the model must know which
        # of the words it just read ends the sentence), other sentences' last words after.
        near = sorted({w for w in re.findall(r"[A-Za-z]{4,}", context)})
        rng.shuffle(near)
        distractors: list[str] = []
        for w in near + [rng.choice(pool) for _ in range(100)]:
            if w.lower() != answer.lower() and w.lower() not in {d.lower() for d in distractors}:
                distractors.append(w)
            if len(distractors) == N_CHOICES - 1:
                break
        label = rng.randrange(N_CHOICES)
        choices = distractors[:label] + [answer] + distractors[label:]
        rows.append({"id": i, "context": context, "choices": choices, "label": label})
    return rows


def write_data(path: pathlib.Path = DATA) -> int:
    from pydoc_data.topics import topics

    rows = make_examples(topics)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return len(rows)


def lm_eval_args(url: str, tokenizer: str, batch_size: int, concurrent: int) -> dict[str, Any]:
    """`local-completions`' model_args against a Subway server at `url`."""
    from subway.worker.default_model import DEFAULT_MODEL_NAME

    return {
        "base_url": f"{url}/v1/completions",
        "model": DEFAULT_MODEL_NAME,
        "tokenizer": tokenizer,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "batch_size": batch_size,  # prompts per request
        "num_concurrent": concurrent,  # requests in flight
        "max_retries": 1,
        "timeout": 600,
    }


def evaluate(model_args: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` on the task; the results dict, samples included."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        limit=limit,
        log_samples=True,
        bootstrap_iters=1000,  # a mean's stderr is analytic: no bootstrap runs
    )


def summarize(name: str, out: dict[str, Any], seconds: float) -> dict[str, Any]:
    """One setting's row: scores, stderrs, n, wall time and per-example acc by doc id."""
    m = out["results"][TASK]
    per_doc = {
        s["doc_id"]: {"acc": float(s["acc"]), "acc_norm": float(s["acc_norm"])}
        for s in out["samples"][TASK]
    }
    return {
        "setting": name,
        "flags": SETTINGS[name],
        "n": len(per_doc),
        "acc": m["acc,none"],
        "acc_stderr": m["acc_stderr,none"],
        "acc_norm": m["acc_norm,none"],
        "acc_norm_stderr": m["acc_norm_stderr,none"],
        "seconds": seconds,
        "per_doc": per_doc,
    }


def paired(base: dict[str, Any], other: dict[str, Any], metric: str) -> tuple[float, float, int]:
    """Mean of other - base over the shared examples, its stderr, and how many differ."""
    ids = sorted(set(base["per_doc"]) & set(other["per_doc"]))
    d = [other["per_doc"][i][metric] - base["per_doc"][i][metric] for i in ids]
    if len(d) < 2:
        return math.nan, math.nan, 0
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d)), sum(x != 0 for x in d)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'setting':<10} {'task':<22} {'metric':<9} {'score':>7} {'stderr':>7} {'n':>5} "
        f"{'vs bf16':>8} {'±':>5} {'flips':>5} {'time s':>7}"
    )
    lines = [head, "-" * len(head)]
    base = rows[0]
    for r in rows:
        for metric in ("acc", "acc_norm"):
            if r is base:
                diff = f"{'':>8} {'':>5} {'':>5}"
            else:
                mean, se, flips = paired(base, r, metric)
                diff = f"{100 * mean:>+8.2f} {100 * se:>5.2f} {flips:>5}"
            lines.append(
                f"{r['setting']:<10} {TASK:<22} {metric:<9} {100 * r[metric]:>7.2f} "
                f"{100 * r[metric + '_stderr']:>7.2f} {r['n']:>5} {diff} {r['seconds']:>7.0f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--limit", type=int, default=None, help="the first N examples only")
    # One thread: scores do not depend on speed, and two OpenMP threads on a CPU shared with
    # another benchmark ran 30x slower here (spinning barriers); one does not.
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per request")
    p.add_argument("--concurrent", type=int, default=2, help="requests in flight")
    p.add_argument("--out", help="write the rows (per-example acc included) as JSON")
    p.add_argument("--make-data", action="store_true", help=f"regenerate {DATA.name} and exit")
    a = p.parse_args(argv)
    if a.make_data:
        print(f"{write_data()} examples -> {DATA}")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from subway.worker.default_model import ensure_default_model

    tokenizer = ensure_default_model()
    settings = ["bfloat16", *[s for s in a.settings if s != "bfloat16"]]
    if "bfloat16" not in a.settings:
        settings = a.settings
    rows = []
    for name in settings:
        with compare.subway_server(f"lm-eval-{name}", SETTINGS[name], a.threads) as url:
            t0 = time.monotonic()
            out = evaluate(lm_eval_args(url, tokenizer, a.batch_size, a.concurrent), a.limit)
            rows.append(summarize(name, out, time.monotonic() - t0))
        print(f"{name}: acc {rows[-1]['acc']:.4f} in {rows[-1]['seconds']:.0f} s", flush=True)
    print(table(rows))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
