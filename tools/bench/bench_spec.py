"""Speculative decoding (n-gram prompt lookup) against none, side by side in one run.

Subway is served twice, the same engine flags as the vLLM comparison (bfloat16, both
cores), once plain and once with `--speculative-config`; ABBA rounds (plain, spec, spec,
plain for `--rounds 2`), each server warmed up first. On each it measures:

- `edit`: a repetition-heavy workload, one request at a time: a paragraph, then the
  instruction to repeat it with one word replaced (the chat template applied, greedy,
  ending at EOS): what an editing assistant does. Time per output token (TPOT: the time
  after the first token over the tokens after it) is the single-stream latency;
  streamed chunks carry several tokens once drafts are accepted, so the gap between
  chunks (ITL) is not.
- `c64`: the standard workload (64 requests, seed 0) all at once, as in vs_vllm:
  speculation is off above `disable_by_batch_size`, so this should not change.

It prints per round and the medians: output tok/s, TPOT p50, the draft tokens proposed
and accepted (from /metrics), and whether both servers gave the same greedy text.

    python -m subway.tools.bench.bench_spec --out docs/bench/spec.json [--rounds 2]

`--sweep` instead finds where speculation stops paying: plain against drafts at every
batch size (`disable_by_batch_size` 64), `edit` twice over (16 requests) at concurrency 1,
4, 8 and 16, and the standard workload at 16: output tok/s of each and the ratio.

`--equality` instead runs the `edit` prompts offline (`subway.LLM`, greedy) with and
without drafts, in float32 and bfloat16, and prints per prompt whether the outputs are
identical, or where they part and the two tokens' logprobs there.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import httpx

from subway.tools.bench import bench_serving, compare, vs_vllm, workload

SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 1, "disable_by_batch_size": 4}'
)

PARAGRAPHS = (
    "The harbour was quiet at dawn. Fishing boats rocked on the grey water, their ropes "
    "creaking against the posts, and the gulls waited on the harbour wall for the first "
    "catch of the day. An old man in a yellow coat walked slowly along the pier, checking "
    "each knot as he went, while the baker at the corner opened his shutters and the smell "
    "of fresh bread drifted down towards the sea.",
    "Our team meets every Monday morning to plan the week. Each person says what they "
    "finished, what they are working on, and what is blocking them. The meeting should "
    "never take longer than fifteen minutes; longer discussions move to a separate call "
    "with only the people who need to be there. Notes are written in the shared document "
    "and the action items are assigned before anyone leaves the room.",
    "To install the library, first create a virtual environment and activate it. Then run "
    "the install command with the version you need, and check that the import works by "
    "starting the interpreter and printing the version number. If the import fails, make "
    "sure that the environment is active and that no older copy of the library is "
    "installed elsewhere on the path. The documentation lists the supported versions.",
    "The garden behind the library has three long beds of vegetables and a small pond. In "
    "spring the children from the school next door plant beans, peas and lettuce, and in "
    "summer they come back to water them and to pull out the weeds. By the end of August "
    "the beans climb higher than the fence, and the librarian brings a basket every Friday "
    "so that visitors can take some home.",
    "When the train left the station, the rain had already stopped. Through the window the "
    "fields were bright and wet, and the hills in the distance were still covered by low "
    "clouds. A woman across the aisle opened a thick book and began to read, a student "
    "next to her fell asleep against his backpack, and the conductor came through the "
    "carriage, calling out the name of the next town.",
    "Please remember that the office will be closed on Friday for the annual maintenance "
    "of the heating system. All staff should save their work and shut down their "
    "computers before leaving on Thursday evening. The building will open again on Monday "
    "at eight o'clock as usual. If you need to collect anything during the closure, "
    "contact the facilities team by Wednesday so that they can arrange access.",
    "The recipe is simple. Mix the flour, the sugar and a pinch of salt in a large bowl, "
    "then add the eggs one at a time and stir until the batter is smooth. Pour in the "
    "milk slowly, so that no lumps form, and leave the batter to rest for half an hour. "
    "Heat a little butter in a pan, pour in a thin layer of batter and cook each side "
    "until it is golden.",
    "At the edge of the forest there is a small wooden hut where the rangers keep their "
    "maps and tools. Visitors are asked to sign the book by the door before they set out "
    "on the longer trails, and to sign again when they return. The rangers check the book "
    "every evening; if a name has no second signature by nightfall, they go out with "
    "lanterns to look for the walker.",
)
SWAPS = (
    ("boats", "ships"), ("team", "group"), ("library", "package"), ("beans", "peas"),
    ("train", "bus"), ("office", "building"), ("batter", "mixture"), ("rangers", "wardens"),
)  # fmt: skip


def edit_requests(tokenizer: Any, max_tokens: int = 256) -> list[workload.Request]:
    """One request per paragraph: repeat it with one word replaced (the chat template applied)."""
    out = []
    for i, (text, (a, b)) in enumerate(zip(PARAGRAPHS, SWAPS, strict=True)):
        ask = (
            f"Here is a paragraph:\n\n{text}\n\nRepeat the paragraph exactly, word for word, "
            f"but replace the word '{a}' with '{b}' everywhere. Write only the paragraph."
        )
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
        )
        n = len(tokenizer.encode(prompt, add_special_tokens=False))
        out.append(workload.Request(f"edit-{i}", prompt, n, max_tokens))
    return out


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("subway:spec_decode_") and "_total" in line:
            name = line.split("{")[0].removeprefix("subway:spec_decode_").removesuffix("_total")
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def measure(url: str, edits: list[workload.Request], std: list[workload.Request]) -> dict:
    bench_serving.benchmark(url, compare.warmup_requests(), progress=False, keep_records=False)
    out: dict[str, Any] = {}
    for name, reqs, conc, extra in (
        ("edit", edits, 1, {"ignore_eos": False}),
        ("c64", std, 64, None),
    ):
        before = spec_counters(url)
        quiet = vs_vllm.wait_for_quiet(0.3, 600.0)
        r = bench_serving.benchmark(url, reqs, max_concurrency=conc, progress=False, extra=extra)
        after = spec_counters(url)
        m = r["metrics"]
        out[name] = {
            "foreign_cores_before": quiet,
            "output_throughput": m["output_throughput"],
            "tpot_ms": m["tpot_ms"],
            "ttft_ms": m["ttft_ms"],
            "output_tokens": m["output_tokens"],
            "failed": m["failed"],
            "spec": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
        }
        print(f"  {name}: {m['output_throughput']:.1f} tok/s, TPOT p50 {m['tpot_ms']['p50']:.2f} "
              f"ms, {m['output_tokens']} tokens, spec {out[name]['spec']}", flush=True)  # fmt: skip
    out["greedy_text"] = vs_vllm.greedy_text(url, edits[0], 96)
    return out


def equality(model: str, spec: str) -> None:
    """Greedy outputs offline with and without drafts: identical, or where they part."""
    from subway.ipc.messages import SamplingParams
    from subway.llm import LLM

    tok = workload.load_tokenizer(model)
    prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in edit_requests(tok)]
    sp = SamplingParams(temperature=0.0, max_tokens=256, logprobs=2)
    for dtype in ("float32", "bfloat16"):
        outs = {}
        for cfg in ("", spec):
            eng = LLM(path=model, dtype=dtype, speculative_config=cfg)
            outs[cfg] = [eng.generate([p], sp)[0] for p in prompts]
        same = 0
        for i, (a, b) in enumerate(zip(outs[""], outs[spec], strict=True)):
            if a.token_ids == b.token_ids:
                same += 1
                continue
            n = min(len(a.token_ids), len(b.token_ids))
            j = next((k for k in range(n) if a.token_ids[k] != b.token_ids[k]), n)
            print(f"{dtype} edit {i}: parts at token {j}: plain {a.token_ids[j : j + 1]} "
                  f"(top {a.top_ids[j] if j < len(a.top_ids) else '-'}), drafts "
                  f"{b.token_ids[j : j + 1]} (top {b.top_ids[j] if j < len(b.top_ids) else '-'})")  # fmt: skip
        print(f"{dtype}: {same} of {len(prompts)} outputs identical", flush=True)


def sweep(edits: list[workload.Request], std: list[workload.Request], base: list[str],
          spec: str, threads: int) -> dict:  # fmt: skip
    """Output tok/s, plain and always speculating, per workload and concurrency."""
    always = json.loads(spec) | {"disable_by_batch_size": 64}
    systems = {"plain": base, "spec": [*base, "--speculative-config", json.dumps(always)]}
    edits2 = [workload.Request(f"{r.id}-{k}", r.prompt, r.prompt_tokens, r.max_tokens)
              for k in range(2) for r in edits]  # fmt: skip
    plan = [(f"edit c{c}", edits2, c, {"ignore_eos": False}) for c in (1, 4, 8, 16)]
    plan.append(("standard c16", std, 16, None))
    out: dict[str, dict[str, float]] = {}
    for name, flags in systems.items():
        with compare.subway_server(f"sweep-{name}", flags, threads) as url:
            bench_serving.benchmark(url, compare.warmup_requests(), progress=False,
                                    keep_records=False)  # fmt: skip
            for setting, reqs, conc, extra in plan:
                vs_vllm.wait_for_quiet(0.3, 600.0)
                r = bench_serving.benchmark(url, reqs, max_concurrency=conc, progress=False,
                                            extra=extra)  # fmt: skip
                tps = r["metrics"]["output_throughput"]
                out.setdefault(setting, {})[name] = tps
                print(f"  {name} {setting}: {tps:.1f} tok/s", flush=True)
    for v in out.values():
        v["spec_over_plain"] = v["spec"] / v["plain"]
    print(json.dumps(out, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="HF folder (default: the default model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spec", default=SPEC, help="the --speculative-config of the spec server")
    p.add_argument("--out", default="")
    p.add_argument("--equality", action="store_true", help="offline greedy equality instead")
    p.add_argument("--sweep", action="store_true", help="where drafts stop paying, instead")
    a = p.parse_args(argv)
    from subway.worker.default_model import ensure_default_model

    model = a.model or ensure_default_model()
    if a.equality:
        equality(model, a.spec)
        return
    tok = workload.load_tokenizer(model)
    edits = edit_requests(tok)
    std = workload.generate(tok, num_requests=64, seed=0)
    base = [*vs_vllm.ENGINE_FLAGS, *(["--model", a.model] if a.model else [])]
    if a.sweep:
        result = sweep(edits, std, base, a.spec, a.threads)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=2)
        return
    systems = {"plain": base, "spec": [*base, "--speculative-config", a.spec]}
    runs: dict[str, list[dict]] = {"plain": [], "spec": []}
    names = list(systems)
    for i in range(a.rounds):
        for name in names if i % 2 == 0 else reversed(names):
            print(f"round {i + 1}: {name}", flush=True)
            with compare.subway_server(f"spec-{name}", systems[name], a.threads) as url:
                runs[name].append(measure(url, edits, std))

    def med(name: str, setting: str, key: str, stat: str = "") -> float:
        vals = [r[setting][key][stat] if stat else r[setting][key] for r in runs[name]]
        return statistics.median(vals)

    summary = {
        "edit_tpot_p50_ms": {n: med(n, "edit", "tpot_ms", "p50") for n in names},
        "edit_tok_s": {n: med(n, "edit", "output_throughput") for n in names},
        "c64_tok_s": {n: med(n, "c64", "output_throughput") for n in names},
        "same_greedy_text": len({r["greedy_text"] for rs in runs.values() for r in rs}) == 1,
    }
    s = summary
    s["edit_tpot_x_lower"] = s["edit_tpot_p50_ms"]["plain"] / s["edit_tpot_p50_ms"]["spec"]
    s["c64_spec_over_plain"] = s["c64_tok_s"]["spec"] / s["c64_tok_s"]["plain"]
    spec_edit = [r["edit"]["spec"] for r in runs["spec"]]
    drafted = sum(x.get("num_draft_tokens", 0.0) for x in spec_edit)
    s["edit_acceptance"] = sum(x.get("num_accepted_tokens", 0.0) for x in spec_edit) / max(
        1.0, drafted
    )
    print(json.dumps(summary, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"spec_config": a.spec, "runs": runs, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
