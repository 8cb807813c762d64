"""`kvpool bench kvtest`: kvtest's benchmark modes (set/get, local/cross-node) over data sizes and
threads, from kvtest's config keys; every get checks its bytes; results also as kvtest's CSV rows."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvpool.core.bench import kvtest_csv
from kvpool.core.bench.kvtest_suite import KvtestOptions, _one
from kvpool.core.errors import PoolUnavailable
from kvpool.core.nats_server import free_port


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        assert f.readline().strip() == ",".join(kvtest_csv.HEADER)
        f.seek(0)
        return list(csv.DictReader(f))


def test_every_mode_quick(bench, tmp_path: Path) -> None:
    ran = bench("kvtest", "--quick", "--json", "--ops", "40", "--csv", str(tmp_path / "out.csv"))
    assert ran.rc == 0, ran.err
    m, ratios = ran.json["metrics"], ran.json["ratios"]
    assert m["failed_calls"] == 0 and m["block_sizes"] == [64 << 10]
    for mode in ("set_local", "get_local", "set_cross_node", "get_cross_node"):
        assert m[f"{mode}_64KiB_fail"] == 0 and m[f"{mode}_64KiB_gbps"] > 0
        assert ratios[f"{mode}_vs_memcpy"] > 0
        assert m[f"{mode}_64KiB_p50_us"] <= m[f"{mode}_64KiB_p99_us"]
    assert m["local_worker"].endswith(".sock")  # this node's worker through shared memory; the other over TCP
    rows = _rows(tmp_path / "out.csv")
    assert [r["op"] for r in rows] == ["set_local", "get_local", "set_cross_node", "get_cross_node"]
    for r in rows:
        assert (int(r["count"]), int(r["success"]), int(r["fail"]), int(r["bytes"])) == (40, 40, 0, 40 * (64 << 10))


def test_kvtest_config_threads_sizes_and_batches(bench, tmp_path: Path) -> None:
    cfg = {"mode": "benchmark", "test_mode": ["set_cross_node", "get_cross_node"], "data_sizes": ["16KiB", "128KiB"],
           "num_threads": 3, "target_qps": 2000, "batch_keys_count": 4, "ops": 30}
    (tmp_path / "bench.json").write_text(json.dumps(cfg))
    ran = bench("kvtest", "--json", "--config", str(tmp_path / "bench.json"), "--csv", str(tmp_path / "out.csv"))
    assert ran.rc == 0, ran.err
    m = ran.json["metrics"]
    assert (m["threads"], m["batch_size"], m["target_qps"], m["block_sizes"]) == (3, 4, 2000.0, [16 << 10, 128 << 10])
    rows = _rows(tmp_path / "out.csv")
    assert [r["op"] for r in rows] == ["set_cross_node_16KiB", "get_cross_node_16KiB", "set_cross_node_128KiB",
                                       "get_cross_node_128KiB"]
    assert [int(r["bytes"]) for r in rows] == [30 * 4 * s for s in (16 << 10, 16 << 10, 128 << 10, 128 << 10)]


def test_instance_config_starts_this_nodes_worker_and_joins_the_other(bench, spawn, tmp_path: Path) -> None:
    other = spawn()
    port = free_port()
    cfg = {"instance_id": 0, "listen_port": port, "rocksdb_store_dir": str(tmp_path / "rocksdb0"),
           "remote_worker": other.address, "test_mode": "set_local,get_cross_node", "ops": 20}
    (tmp_path / "i0.json").write_text(json.dumps(cfg))
    ran = bench("kvtest", "--json", "--quick", "--config", str(tmp_path / "i0.json"))
    assert ran.rc == 0, ran.err
    m = ran.json["metrics"]
    assert m["remote_worker"] == other.address and m["local_worker"].endswith(f"worker-{port}.sock")
    assert m["set_local_64KiB_fail"] == m["get_cross_node_64KiB_fail"] == 0
    assert (tmp_path / "rocksdb0" / "data.mdb").exists()


def test_bad_kvtest_configs_are_named(bench, tmp_path: Path) -> None:
    for cfg, named in (({"test_mode": "cache"}, "test_mode cache"), ({"key_pool_size": 8}, "belong to cache mode"),
                       ({"listen_port": 8080}, "give both"), ({"num_threads": 0}, "num_threads 0"),
                       ({"duration": 5}, "not duration"), ({"mode": "cache"}, "kvtest's cache mode"),
                       ({"listen_port": free_port(), "remote_worker": f"127.0.0.1:{free_port()}"}, "does not answer")):
        (tmp_path / "bad.json").write_text(json.dumps(cfg))
        ran = bench("kvtest", "--quick", "--config", str(tmp_path / "bad.json"))
        assert ran.rc == 2 and named in ran.err and "Traceback" not in ran.err, (cfg, ran.err)


def test_clients_that_cannot_connect_end_the_mode_with_an_error() -> None:
    """The clock starts once every client is connected: one that cannot connect stops the mode at
    once with PoolUnavailable, rather than leaving the others waiting for it."""
    opts = KvtestOptions(modes=["set_cross_node"], sizes=[16 << 10], threads=3, ops=10)
    with pytest.raises(PoolUnavailable, match="cannot connect to worker"):
        _one(opts, "set_cross_node", 16 << 10, f"127.0.0.1:{free_port()}", "r")
