"""`kvpool bench streams` runs end to end and prints its JSON contract as the last line."""
from __future__ import annotations

import argparse
import json

from kvpool.core.bench import SUITES
from kvpool.streams import bench_suite


def test_bench_streams_quick_json(capsys):
    assert SUITES["streams"] == "kvpool.streams.bench_suite"
    assert bench_suite.run(argparse.Namespace(quick=True, json=True, requests=1)) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["suite"] == "streams"
    assert set(last["ratios"]) == {"handoff_vs_raw_socket", "handoff_vs_nats_inline", "handoff_vs_memcpy",
                                   "handoff_vs_raw_socket_oneway", "handoff_vs_pool_puts"}
    metrics = last["metrics"]
    for name in ("notify_p50_us", "notify_p99_us", "first_layer_p50_us", "js_notify_p50_us", "handoff_gbps",
                 "handoff_tcp_gbps", "memcpy_gbps", "raw_socket_oneway_gbps"):
        assert metrics[name] > 0, name
