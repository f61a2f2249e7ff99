"""The Grafana dashboard (docs/grafana/subway.json): it is tools/grafana.py's output, and every
metric it queries is served, per engine, by a live server with two data-parallel engines."""

from __future__ import annotations

import json
import pathlib

import httpx
from prometheus_client.parser import text_string_to_metric_families

from subway.tools import grafana

from serving import TINY_FLAGS, complete

BOARD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "grafana" / "subway.json"


def test_the_file_is_the_generators_output():
    assert json.loads(BOARD.read_text()) == grafana.dashboard()


def test_every_query_reads_only_subway_metrics_and_each_panel_has_one():
    board = grafana.dashboard()
    graphs = [p for p in board["panels"] if p["type"] == "timeseries"]
    assert len(graphs) >= 20 and all(p["targets"] for p in graphs)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert "subway:request_time_per_output_token_seconds_bucket" in grafana.queried_metrics(board)


def test_every_metric_queried_is_on_a_server_with_two_engines(servers, tiny_models):
    server = servers.get(tiny_models["llama"], *TINY_FLAGS, "-dp", "2")
    for i in range(4):  # requests on both engines: the per-engine route series appear
        complete(server.url, [5 + i, 17, 300, 42, 7], 4)
    text = httpx.get(server.url + "/metrics", timeout=5).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    served = {s.name for s in samples}
    missing = grafana.queried_metrics(grafana.dashboard()) - served
    assert not missing, f"queried but not served: {sorted(missing)}"
    engines = {s.labels["engine"] for s in samples if s.name == "subway:num_requests_running"}
    assert engines == {"0", "1"}
    tpot = [s for s in samples if s.name == "subway:request_time_per_output_token_seconds_count"]
    assert tpot and tpot[0].value >= 4  # each request of 4 tokens gave one
