"""The Grafana dashboard in docs/grafana/subway.json, written from this one description:

    python -m subway.tools.grafana > docs/grafana/subway.json

Every query is PromQL over the names `/metrics` serves (frontend/metrics.py);
tests/test_grafana.py checks the file is this module's output and that every metric it
queries is on a live server with two data-parallel engines. Import it in Grafana
(Dashboards, New, Import) and pick the Prometheus data source that scrapes Subway.
"""

from __future__ import annotations

import json
import re

# (title, unit, [(legend, expr)]); `$model` is the dashboard's model_name variable.
SEL = '{model_name=~"$model"}'
RATE = "[$__rate_interval]"


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate({metric}_bucket{SEL}{RATE})))")
        for q in ("50", "90", "99")
    ]


OVERVIEW: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Output tokens / s", "short", [
        ("generated", f"sum(rate(subway:generation_tokens_total{SEL}{RATE}))"),
        ("prompt", f"sum(rate(subway:prompt_tokens_total{SEL}{RATE}))"),
    ]),
    ("Requests finished / s, by reason", "reqps", [
        ("{{finished_reason}}",
         f"sum by (finished_reason) (rate(subway:request_success_total{SEL}{RATE}))"),
    ]),
    ("Time to first token", "s", _quantiles("subway:time_to_first_token_seconds")),
    ("Inter-token latency", "s", _quantiles("subway:inter_token_latency_seconds")),
    ("Time per output token", "s", _quantiles("subway:request_time_per_output_token_seconds")),
    ("End-to-end latency", "s", _quantiles("subway:e2e_request_latency_seconds")),
    ("Queue time", "s", _quantiles("subway:request_queue_time_seconds")),
    ("Requests running / waiting", "short", [
        ("running", f"sum(subway:num_requests_running{SEL})"),
        ("waiting", f"sum(subway:num_requests_waiting{SEL})"),
    ]),
    ("KV cache use", "percentunit", [
        ("engine {{engine}}", f"subway:kv_cache_usage_perc{SEL}"),
    ]),
    ("Prefix cache hit rate", "percentunit", [
        ("hits / lookups", f"sum(rate(subway:prefix_cache_hits_total{SEL}{RATE})) / "
                           f"sum(rate(subway:prefix_cache_queries_total{SEL}{RATE}))"),
    ]),
    ("Preemptions / s", "short", [
        ("recompute", f"sum(rate(subway:num_preemptions_total{SEL}{RATE}))"),
        ("displaced", f"sum(rate(subway:num_displaced_total{SEL}{RATE}))"),
    ]),
    ("Speculative decoding: acceptance", "percentunit", [
        ("accepted / drafted",
         f"sum(rate(subway:spec_decode_num_accepted_tokens_total{SEL}{RATE})) / "
         f"sum(rate(subway:spec_decode_num_draft_tokens_total{SEL}{RATE}))"),
    ]),
    ("Grammar compiles / s", "short", [
        ("{{result}}", f"sum by (result) (rate(subway:grammar_compiles_total{SEL}{RATE}))"),
    ]),
    ("Grammar compile time", "s", _quantiles("subway:grammar_compile_seconds")),
]  # fmt: skip

PER_ENGINE: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Running requests by engine", "short", [
        ("engine {{engine}} ({{role}})", f"subway:num_requests_running{SEL}"),
    ]),
    ("Batch size by engine", "short", [
        ("engine {{engine}} ({{role}})", f"subway:batch_size{SEL}"),
    ]),
    ("Worker busy share by engine", "percentunit", [
        ("engine {{engine}}",
         f"rate(subway:worker_busy_seconds_total{SEL}{RATE}) / "
         f"(rate(subway:worker_busy_seconds_total{SEL}{RATE}) + "
         f"rate(subway:worker_idle_seconds_total{SEL}{RATE}))"),
    ]),
    ("Steps / s by engine", "short", [
        ("engine {{engine}}", f"rate(subway:num_steps_total{SEL}{RATE})"),
    ]),
    ("Requests routed to each engine / s", "reqps", [
        ("engine {{engine}}: {{reason}}",
         f"sum by (engine, reason) (rate(subway:routed_requests_total{SEL}{RATE}))"),
    ]),
    ("Disaggregation: KV copy time p90, failures", "s", [
        ("engine {{engine}} p90", "histogram_quantile(0.9, sum by (le, engine) "
                                  f"(rate(subway:kv_transfer_seconds_bucket{SEL}{RATE})))"),
        ("engine {{engine}} failures / s", f"rate(subway:kv_transfer_failures_total{SEL}{RATE})"),
    ]),
    ("Messages refused (IPC)", "short", [
        ("engine {{engine}}", f"rate(subway:ipc_rejected_messages_total{SEL}{RATE})"),
    ]),
]  # fmt: skip


def _panel(pid: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int):
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    panels: list[dict] = []
    y = 0
    for row_title, group in (("Overview", OVERVIEW), ("Per engine (data parallel, disaggregation)", PER_ENGINE)):  # fmt: skip
        panels.append({"id": len(panels) + 1, "type": "row", "title": row_title,
                       "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                       "panels": []})  # fmt: skip
        y += 1
        for i, (title, unit, targets) in enumerate(group):
            panels.append(_panel(len(panels) + 1, title, unit, targets, 12 * (i % 2), y))
            y += 8 * (i % 2)
        y += 8 * (len(group) % 2)
    return {
        "title": "Subway",
        "uid": "subway-serving",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "tags": ["subway", "llm-serving"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                },
                {
                    "name": "model",
                    "type": "query",
                    "label": "Model",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(subway:num_requests_running, model_name)",
                    "definition": "label_values(subway:num_requests_running, model_name)",
                    "refresh": 1,
                },
            ]
        },  # fmt: skip
        "panels": panels,
    }


def queried_metrics(board: dict) -> set[str]:
    """The metric names the dashboard's queries read, as the exposition names them (a
    histogram's _bucket and a counter's _total included)."""
    names: set[str] = set()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            names.update(re.findall(r"subway:[a-zA-Z0-9_]+", target["expr"]))
    for var in board["templating"]["list"]:
        names.update(re.findall(r"subway:[a-zA-Z0-9_]+", var.get("query", "")))
    return names


def main() -> None:
    print(json.dumps(dashboard(), indent=2))


if __name__ == "__main__":
    main()
