"""`kvpool bench streams` runs end to end and prints its JSON contract as the last line."""
from __future__ import annotations

import argparse
import json

import pytest

from kvpool.core.bench import SUITES
from kvpool.streams import bench_suite


def test_bench_streams_quick_json(capsys):
    assert SUITES["streams"] == "kvpool.streams.bench_suite"
    assert bench_suite.run(argparse.Namespace(quick=True, json=True, requests=1)) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["suite"] == "streams"
    assert set(last["ratios"]) == {"handoff_vs_raw_socket", "handoff_vs_nats_inline", "handoff_vs_memcpy",
                                   "handoff_vs_raw_socket_oneway", "handoff_vs_pool_puts", "first_layer_vs_nats_hop",
                                   "notify_vs_nats_hop"}
    metrics = last["metrics"]
    for name in ("notify_p50_us", "notify_p99_us", "first_layer_p50_us", "js_notify_p50_us", "nats_hop_p50_us",
                 "handoff_gbps", "handoff_tcp_gbps", "memcpy_gbps", "raw_socket_oneway_gbps"):
        assert metrics[name] > 0, name
    hop = metrics["nats_hop_p50_us"]
    assert last["ratios"]["notify_vs_nats_hop"] == pytest.approx(metrics["notify_p50_us"] / hop, abs=2e-3)
