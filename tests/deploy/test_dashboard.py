"""The Grafana dashboard (dashboards/kvpool.json) charts metrics a live worker really exports: a worker
with --metrics-port serves some traffic, is scraped, and every panel's queries name only metrics (or
histogram series) found in the scrape; panels tile the grid and use the dashboard's datasource."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.core import PoolClient
from kvpool.core.nats_server import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "kvpool.json"
FUNCTIONS = {"sum", "rate", "histogram_quantile", "by", "le", "op", "instance", "transport", "direction"}


def _exprs(dash: dict) -> list[tuple[str, str]]:
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    out += [("variable " + v["name"], v["definition"]) for v in dash["templating"]["list"] if "definition" in v]
    return out


@pytest.fixture(scope="module")
def dash() -> dict:
    return dict(json.loads(DASHBOARD.read_text()))


@pytest.fixture
def scraped(spawn, tmp_path) -> set[str]:
    """Every metric and series name a worker exports after puts, hits and misses (local and remote)."""
    port = free_port()
    w = spawn(dram_bytes="64MiB", extra=["--metrics-port", str(port)])
    with PoolClient(mode="local", worker=w.unix_path) as shm, PoolClient(mode="local", worker=w.address) as tcp:
        for i in range(0, 96, 4):  # 96 MiB through 64: evictions
            shm.batch_put([f"k{j}" for j in range(i, i + 4)], [bytes(1 << 20)] * 4)
        tcp.get("k95"), tcp.get("absent")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")  # declared even before its first sample
    return names


def test_every_query_names_exported_metrics(dash: dict, scraped: set[str]) -> None:
    assert {"kvpool_ops_total", "kvpool_op_seconds_bucket", "kvpool_cache_hits_dram_total"} <= scraped
    used = set()
    for where, expr in _exprs(dash):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), (where, expr)
        for name in re.findall(r"\bkvpool_[a-z_]+\b", expr):
            assert name in scraped, f"{where}: {name} is not exported by a worker"
            used.add(name)
    assert len(used) >= 15


def test_panels_cover_what_operators_ask_for(dash: dict) -> None:
    titles = {p["title"] for p in dash["panels"]}
    assert {"Hit rate per tier", "Operations per second", "Bytes per second", "Request latency", "Fill",
            "Evictions and tier moves", "Connections", "Errors"} <= titles
    latency = next(p for p in dash["panels"] if p["title"] == "Request latency")
    starts = {t["expr"][:23].rstrip(",") for t in latency["targets"]}
    assert {"histogram_quantile(0.5", "histogram_quantile(0.99"} <= starts


def test_layout_ids_and_datasource(dash: dict) -> None:
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']} overlaps another"
        cells |= mine
        assert p["datasource"]["uid"] == "${datasource}" and all(t["refId"] for t in p["targets"])
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "instance"}
