"""How often sampled structured outputs are valid JSON: open schemas (free-form strings
and arrays), temperature 0.8, `max_tokens` 256, the default model.

For each schema, `--requests` chat requests (distinct seeds, `--concurrency` at a
time) ask for an answer under `response_format` json_schema; per schema it prints how
many answers parse (`json.loads`), how many also validate (`jsonschema`), how many
finished on `length` (the budget ran out: the answer is cut, unless the grammar's
closing window closed it first), and the mean completion tokens.

Starts a `subway serve` of the default model (extra serve flags after `--`) or drives a
running one (`--url`). `--closing-window N` starts the server with
`SUBWAY_JSON_CLOSING_WINDOW=N` (0: off; see `worker/json_budget.py`), so that runs with
and without the feature alternate on the same tree:

    python -m subway.tools.bench.bench_json_validity                 # the default window
    python -m subway.tools.bench.bench_json_validity --closing-window 0
    python -m subway.tools.bench.bench_json_validity --url http://127.0.0.1:8000 --requests 20

Seeds are `--seed-base + i`: the same base gives the same draws, another base other
ones (the spread between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import httpx
import jsonschema

STR = {"type": "string"}
STRINGS = {"type": "array", "items": STR}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    """An object with every property required and no others (OpenAI's strict form)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "person": (
        _obj({"name": STR, "bio": STR, "hobbies": STRINGS}),
        "Invent a person. Answer in JSON with their name, a bio and a list of hobbies.",
    ),
    "review": (
        _obj(
            {
                "title": STR,
                "body": STR,
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "pros": STRINGS,
                "cons": STRINGS,
            }
        ),
        "Write a review of a pair of headphones in JSON: a title, the review's body, "
        "a rating from 1 to 5, and lists of pros and cons.",
    ),
    "recipe": (
        _obj(
            {
                "name": STR,
                "servings": {"type": "integer"},
                "ingredients": {
                    "type": "array",
                    "items": _obj({"item": STR, "quantity": STR}),
                },
                "steps": STRINGS,
            }
        ),
        "Give me a recipe for pancakes in JSON: its name, servings, the ingredients "
        "(item and quantity) and the steps.",
    ),
    "team": (
        _obj(
            {
                "team": STR,
                "lead": _obj({"name": STR, "email": STR}),
                "members": {
                    "type": "array",
                    "items": _obj({"name": STR, "role": STR, "skills": STRINGS}),
                },
            }
        ),
        "Describe a software team in JSON: the team's name, its lead (name and email) "
        "and its members, each with a name, a role and a list of skills.",
    ),
}


async def _one(
    client: httpx.AsyncClient, url: str, model: str, schema_name: str, seed: int, args: Any
) -> dict[str, Any]:
    schema, prompt = SCHEMAS[schema_name]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": schema_name, "schema": schema},
        },
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "seed": seed,
    }
    r = await client.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    text = choice["message"]["content"] or ""
    parsed = valid = False
    try:
        doc = json.loads(text)
        parsed = True
        jsonschema.validate(doc, schema)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        pass
    return {
        "schema": schema_name,
        "seed": seed,
        "parsed": parsed,
        "valid": valid,
        "finish_reason": choice["finish_reason"],
        "tokens": out["usage"]["completion_tokens"],
        "text": text,
    }


async def run(url: str, args: Any) -> list[dict[str, Any]]:
    """Every request of every schema, `args.concurrency` in flight at a time."""
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        r = await client.get(url + "/v1/models", timeout=30)
        model = r.json()["data"][0]["id"]

        async def gated(name: str, seed: int) -> dict[str, Any]:
            async with gate:
                return await _one(client, url, model, name, seed, args)

        jobs = [
            gated(name, args.seed_base + i) for name in args.schemas for i in range(args.requests)
        ]
        return await asyncio.gather(*jobs)


def summarise(results: list[dict[str, Any]], schemas: list[str]) -> list[dict[str, Any]]:
    """Per schema: requests, parsed, valid, finished on length, mean completion tokens."""
    rows = []
    for name in schemas:
        rs = [r for r in results if r["schema"] == name]
        rows.append(
            {
                "schema": name,
                "n": len(rs),
                "parsed": sum(r["parsed"] for r in rs),
                "valid": sum(r["valid"] for r in rs),
                "length": sum(r["finish_reason"] == "length" for r in rs),
                "mean_tokens": statistics.mean(r["tokens"] for r in rs) if rs else 0.0,
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'schema':<8} {'n':>4} {'parsed':>6} {'valid':>6} {'length':>6} {'mean tok':>8}"]
    for r in rows:
        lines.append(
            f"{r['schema']:<8} {r['n']:>4} {r['parsed']:>6} {r['valid']:>6} {r['length']:>6} "
            f"{r['mean_tokens']:>8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    serve_flags: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_flags = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="", help="a running server (default: start one)")
    p.add_argument("--requests", type=int, default=100, help="per schema")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed-base", type=int, default=0)
    p.add_argument("--schemas", default=",".join(SCHEMAS), help="comma-separated")
    p.add_argument("--closing-window", type=int, default=None,
                   help="SUBWAY_JSON_CLOSING_WINDOW for the server it starts")  # fmt: skip
    p.add_argument("--out", default="", help="write every answer and the summary as JSON")
    args = p.parse_args(argv)
    args.schemas = [s for s in args.schemas.split(",") if s]
    unknown = set(args.schemas) - set(SCHEMAS)
    if unknown:
        p.error(f"unknown schemas: {sorted(unknown)}")

    start = time.monotonic()
    if args.url:
        results = asyncio.run(run(args.url.rstrip("/"), args))
    else:
        from subway.tools.serve_process import ServeProcess

        if args.closing_window is not None:
            os.environ["SUBWAY_JSON_CLOSING_WINDOW"] = str(args.closing_window)
        flags = serve_flags or ["--max-model-len", "2048"]
        with ServeProcess("", *flags, prefix="jsonvalid") as server:
            results = asyncio.run(run(server.url, args))
    rows = summarise(results, args.schemas)
    window = os.environ.get("SUBWAY_JSON_CLOSING_WINDOW", "default") if not args.url else "?"
    print(
        f"temperature {args.temperature}, max_tokens {args.max_tokens}, seeds "
        f"{args.seed_base}..{args.seed_base + args.requests - 1}, closing window {window}, "
        f"{time.monotonic() - start:.0f} s"
    )
    print(format_rows(rows), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": rows, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
