"""The frontend's grammar check: compile time of JSON schemas, cold and from the cache.

Compiles ~20 varied JSON schemas (flat and nested objects, arrays with bounds,
enums, numeric ranges, patterns, formats, anyOf, $defs/$ref) with the
frontend's `GrammarChecker`, for the default model's vocabulary (or
`--model`'s), as a request's check does. Each round starts from a new checker
(an empty compiler cache) and compiles every schema once (`cold`), then
`--repeats` more times (`cached`: the compiler's cache serves them). Prints
p50, p99 and max of each, in milliseconds, per schema and over all.

Then the worker's per-step cost of a mask: 16 and 64 rows of matchers of
`bench_structured`'s schema, each a few tokens in, their bitmask filled in one
call, and the mask applied to float32 logits by xgrammar's CPU kernel and by
ours (`subway_kernels/csrc/mask_cpu.cpp`): median milliseconds of each.

    python -m subway.tools.bench.bench_grammar [--rounds 5] [--repeats 5] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

from subway.frontend.grammar import GrammarChecker
from subway.ipc.messages import Grammar


def _obj(props: dict, required: list[str] | None = None, extra: bool = False) -> dict:
    out = {"type": "object", "properties": props, "additionalProperties": extra}
    out["required"] = list(props) if required is None else required
    return out


def schemas() -> dict[str, dict]:
    """Named schemas, from one field to a few hundred."""
    s = {"type": "string"}
    i = {"type": "integer"}
    person = _obj({"name": {"type": "string", "maxLength": 32}, "age": {**i, "minimum": 0,
                   "maximum": 150}})  # fmt: skip
    address = _obj({"street": s, "city": s, "zip": {"type": "string", "pattern": r"^\d{5}$"}})
    return {
        "one string": _obj({"a": s}),
        "one integer": _obj({"k": i}),
        "person": person,
        "enum": _obj({"colour": {"enum": ["red", "green", "blue", "cyan", "magenta"]}}),
        "big enum (200)": _obj({"city": {"enum": [f"city-{n}" for n in range(200)]}}),
        "ranges": _obj(
            {
                "x": {"type": "number", "minimum": -10, "maximum": 10},
                "n": {**i, "minimum": 100, "maximum": 99999},
            }
        ),  # fmt: skip
        "pattern": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
        "formats": _obj(
            {
                "when": {"type": "string", "format": "date-time"},
                "mail": {"type": "string", "format": "email"},
                "id": {"type": "string", "format": "uuid"},
            }
        ),  # fmt: skip
        "array bounded": _obj(
            {"tags": {"type": "array", "items": s, "minItems": 1, "maxItems": 5}}
        ),  # fmt: skip
        "array of objects": _obj({"people": {"type": "array", "items": person, "maxItems": 10}}),
        "nested 2": _obj({"person": person, "address": address}),
        "nested 5": _nest(5),
        "nested 10": _nest(10),
        "optional fields": _obj({f"f{n}": s for n in range(10)}, required=["f0"]),
        "flat 20": _obj({f"f{n}": (s if n % 2 else i) for n in range(20)}),
        "flat 100": _obj({f"f{n}": (s if n % 3 else {"type": "boolean"}) for n in range(100)}),
        "anyOf": _obj({"v": {"anyOf": [s, i, {"type": "null"}, person]}}),
        "defs and refs": {
            "$defs": {"address": address, "person": person},
            **_obj(
                {
                    "home": {"$ref": "#/$defs/address"},
                    "owner": {"$ref": "#/$defs/person"},
                    "guests": {"type": "array", "items": {"$ref": "#/$defs/person"}},
                }
            ),
        },  # fmt: skip
        "open object": {"type": "object", "additionalProperties": True},
        "order": _obj(
            {
                "id": {**i, "minimum": 1},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 20,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                            "qty": {**i, "minimum": 1, "maximum": 99},
                            "price": {"type": "number", "minimum": 0},
                        }
                    ),
                },
                "paid": {"type": "boolean"},
                "shipping": address,
            }
        ),  # fmt: skip
    }


def _nest(depth: int) -> dict:
    node: dict = _obj({"leaf": {"type": "string"}})
    for d in range(depth):
        node = _obj({f"level{d}": node, f"n{d}": {"type": "integer"}})
    return node


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(model: str, rounds: int, repeats: int) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    named = {name: Grammar("json_schema", json.dumps(s)) for name, s in schemas().items()}
    cold: dict[str, list[float]] = {n: [] for n in named}
    cached: dict[str, list[float]] = {n: [] for n in named}
    for _ in range(rounds):
        checker = GrammarChecker(tok, len(tok), eos)  # an empty cache
        for name, grammar in named.items():
            t = time.perf_counter()
            checker.check(grammar)
            cold[name].append(time.perf_counter() - t)
        for _ in range(repeats):
            for name, grammar in named.items():
                t = time.perf_counter()
                checker.check(grammar)
                cached[name].append(time.perf_counter() - t)
        assert checker.counts["error"] == 0, checker.counts
    width = max(map(len, named)) + 2
    print(f"{len(named)} schemas, vocabulary {len(tok)}, {rounds} rounds x {repeats} repeats")
    print(f"{'schema':<{width}}{'chars':>7}  {'cold p50':>9}{'cold max':>9}  {'cached p50':>11}")
    for name, grammar in named.items():
        print(
            f"{name:<{width}}{len(grammar.spec):>7}  {_ms(cold[name], 0.5):>9.3f}"
            f"{_ms(cold[name], 1.0):>9.3f}  {_ms(cached[name], 0.5):>11.4f}"
        )
    every_cold = [v for vs in cold.values() for v in vs]
    every_cached = [v for vs in cached.values() for v in vs]
    print()
    print(f"{'all (ms)':<{width}}{'n':>7}  {'p50':>9}{'p99':>9}{'max':>9}{'mean':>9}")
    for label, vs in (("cold", every_cold), ("cached", every_cached)):
        print(
            f"{label:<{width}}{len(vs):>7}  {_ms(vs, 0.5):>9.3f}{_ms(vs, 0.99):>9.3f}"
            f"{_ms(vs, 1.0):>9.3f}{1000 * statistics.fmean(vs):>9.3f}"
        )


def _median_ms(fn, times: int = 30) -> float:
    fn()
    samples = []
    for _ in range(times):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return 1000 * statistics.median(samples)


def mask_cost(model: str) -> None:
    """The per-step mask: fill, then apply with xgrammar's kernel and with ours."""
    import random

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from subway.kernels import cpu_ext
    from subway.tools.bench.bench_structured import SCHEMA

    ext = cpu_ext.load()
    tok = AutoTokenizer.from_pretrained(model)
    vocab = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    rng = random.Random(0)
    print()
    print(f"{'mask (ms)':<12}{'fill':>8}{'xgrammar apply':>16}{'our apply':>11}")
    for rows in (16, 64):
        fill, theirs, ours = _mask_step(compiled, rows, vocab, ext, rng)
        print(f"{rows:>4} rows   {fill:>8.3f}{theirs:>16.3f}{ours:>11.3f}")


def _mask_step(compiled, rows: int, vocab: int, ext, rng) -> tuple[float, float, float]:
    """Median ms of one step's fill, xgrammar's apply and ours (NaN without our kernels)."""
    import torch
    import xgrammar as xgr

    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    ids = torch.arange(vocab)
    for m in matchers:  # a few tokens into the schema, each row its own way
        for _ in range(rng.randrange(3, 12)):
            m.fill_next_token_bitmask(bitmask, 0)
            allowed = torch.nonzero((bitmask[0, ids // 32] >> (ids % 32)) & 1).flatten()
            m.accept_token(int(allowed[rng.randrange(len(allowed))]))
    batch = xgr.BatchGrammarMatcher(2)
    idx = list(range(rows))
    logits = torch.randn(rows, vocab)
    fill = _median_ms(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask, idx))
    theirs = _median_ms(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask, indices=idx))
    ours = _median_ms(lambda: ext.apply_token_bitmask(logits, bitmask, idx)) if ext else math.nan
    return fill, theirs, ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="HF folder (default: the default model)")
    ap.add_argument("--rounds", type=int, default=5, help="fresh checkers (cold compiles)")
    ap.add_argument("--repeats", type=int, default=5, help="cached compiles per round")
    args = ap.parse_args()
    model = args.model
    if not model:
        from subway.worker.default_model import ensure_default_model

        model = ensure_default_model(quiet=True)
    run(model, args.rounds, args.repeats)
    mask_cost(model)


if __name__ == "__main__":
    main()
