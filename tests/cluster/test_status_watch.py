"""`kvpool status --watch`: per-worker rates from the difference of two polls, a restart shows no
rates rather than negative ones; against a live cluster the table shows each worker and its traffic."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np

from kvpool.core import PoolClient
from kvpool.core.records import PoolStats, WorkerStats
from kvpool.core.status_watch import rates, render


def _stats(**counters: int) -> WorkerStats:
    fill = {"dram_bytes": 1 << 20, "dram_capacity": 4 << 20, "ssd_bytes": 0}
    return WorkerStats.from_dict({"node_id": "n1", "tcp": "127.0.0.1:7461", "stats": {**fill, **counters}})


def test_rates_are_differences_over_the_interval() -> None:
    prev = PoolStats.of_workers({"w1": _stats(hits_dram=10, hits_ssd=0, misses=10, puts=5, evictions=0),
                                 "w2": _stats(hits_dram=50, misses=0, puts=0)})
    cur = PoolStats.of_workers({"w1": _stats(hits_dram=40, hits_ssd=10, misses=20, puts=25, evictions=4),
                                "w2": _stats(hits_dram=1, misses=0, puts=0),  # restarted: counters went back
                                "w3": _stats(puts=7)})  # joined since the last poll
    r1, r2, r3 = rates(prev, cur, 2.0)
    assert (r1.gets_s, r1.puts_s, r1.hit_rate, r1.evict_s) == (25.0, 10.0, 0.8, 2.0)
    assert r2.gets_s is None and r2.hit_rate is None and r3.puts_s is None
    table = render([r1, r2, r3], "nats://x", 2.0)
    lines = table.splitlines()
    assert lines[1].split()[:4] == ["worker", "node", "address", "gets/s"]
    assert lines[2].split()[:6] == ["w1", "n1", "127.0.0.1:7461", "25.0", "10.0", "80%"]
    assert lines[3].split()[3:6] == ["-", "-", "-"] and lines[-1].split()[0] == "all"


def test_watch_shows_live_workers_and_their_traffic(nats, spawn) -> None:
    for _ in range(2):
        spawn(nats_url=nats.url)
    with PoolClient(mode="cluster", nats_url=nats.url) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 2, 15)
        stop = threading.Event()

        def traffic() -> None:
            keys = [f"w{i}" for i in range(32)]
            pool.batch_put(keys, [np.zeros(4096, dtype=np.uint8)] * len(keys))
            while not stop.is_set():
                pool.batch_get_into(keys, [np.empty(4096, dtype=np.uint8) for _ in keys])

        t = threading.Thread(target=traffic)
        t.start()
        try:
            done = subprocess.run([sys.executable, "-m", "kvpool.core.cli", "status", "--nats-url", nats.url,
                                   "--watch", "--interval", "0.5", "--count", "3"],
                                  capture_output=True, text=True, timeout=60, check=False)
        finally:
            stop.set()
            t.join()
    assert done.returncode == 0, done.stderr
    tables = done.stdout.split("kvpool status ")[1:]
    assert len(tables) == 3
    last = [line.split() for line in tables[-1].splitlines()[2:]]
    workers = [row for row in last if row[0] != "all"]
    assert len(workers) == 2 and last[-1][0] == "all"
    assert all(float(row[3].replace(",", "")) > 0 for row in workers)  # both serve gets
    assert all(row[5] == "100%" for row in workers)


def test_columns_stay_aligned_under_a_long_node_id() -> None:
    long = WorkerStats.from_dict({"node_id": "vm/cb7c2899/4026531833", "tcp": "127.0.0.1:7461",
                                  "stats": {"dram_bytes": 1 << 20, "dram_capacity": 4 << 20, "ssd_bytes": 0}})
    stats = PoolStats.of_workers({"w1": _stats(puts=1), "w2": long})
    lines = render(rates(stats, stats, 2.0), "nats://x", 2.0).splitlines()
    head, rows = lines[1], lines[2:4]
    for row in rows:  # each column begins where its heading does
        assert row.index("127.0.0.1:7461") == head.index("address")
        assert len(row) == len(rows[0])


def test_status_json_gives_each_workers_last_heartbeat(nats, spawn) -> None:
    # `kvpool status --json` showed "ts": 0.0 for every worker (a STATS reply carries no heartbeat time)
    spawn(nats_url=nats.url)
    with PoolClient(mode="cluster", nats_url=nats.url) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
    done = subprocess.run([sys.executable, "-m", "kvpool.core.cli", "status", "--nats-url", nats.url, "--json"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads(done.stdout).values()
    assert abs(entry["ts"] - time.time()) < 30, entry
