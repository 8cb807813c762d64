"""kvtest's two-worker walkthrough with the seed's configs as they are: instance 0 (a writer) and
instance 1 (a reader) each start a worker on their listen_port with their own store folder, wait for
each other, and report cross-node hits and notifications; the reader checks every block's bytes."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from kvpool.core.config import default_state_dir
from kvpool.core.nats_server import free_port

from benchhelp import Ran

SEED_TEST = {"test_mode": "cache", "key_pool_size": 10000, "inference_delay_ms": 100, "hit_rate": 0.8}


def _instance(i: int, port: int, peer: int) -> dict[str, object]:
    """The seed's instance config, on free ports instead of 8080/8081 (CI may run anything there)."""
    return {"instance_id": i, "listen_port": port, "rocksdb_store_dir": f"./rocksdb{i}",
            "remote_worker": f"127.0.0.1:{peer}"}


def _start(cwd: Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "bench", "cache", "--json", *argv], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(proc: subprocess.Popen[str]) -> Ran:
    out, err = proc.communicate(timeout=90)
    return Ran(proc.returncode, out, err)


def test_two_instances_writer_and_reader(tmp_path: Path) -> None:
    p0, p1 = free_port(), free_port()
    (tmp_path / "writer0.json").write_text(json.dumps(_instance(0, p0, p1)))
    (tmp_path / "reader1.json").write_text(json.dumps(_instance(1, p1, p0)))
    (tmp_path / "cache.json").write_text(json.dumps(SEED_TEST))
    nats_port = free_port()  # the first instance starts a nats-server there
    sizing = ["--cluster", f"nats://127.0.0.1:{nats_port}", "--block-size", "64KiB", "--dram-bytes", "64MiB"]
    writer = _start(tmp_path, "--config", "writer0.json", "--config", "cache.json", "--role", "writer",
                    "--duration", "10", *sizing)
    reader = _start(tmp_path, "--config", "reader1.json", "--config", "cache.json", "--role", "reader",
                    "--duration", "4", "--csv", "reader.csv", *sizing)
    r, w = _done(reader), _done(writer)
    assert w.rc == 0, w.err[-3000:]
    assert r.rc == 0, r.err[-3000:]
    wm, rm = w.json["metrics"], r.json["metrics"]
    assert wm["instance"] == "kvtest-0" and rm["instance"] == "kvtest-1"
    assert wm["pairing"] == rm["pairing"] == "ok"
    # the lock that kept the two from both starting a nats-server is gone with them
    assert not (default_state_dir() / f"kvpool-kvtest-nats-{nats_port}.lock").exists()
    assert "kvtest instance 1" in rm["pool"] and f"peer 127.0.0.1:{p0}" in rm["pool"]
    # hits split by the node that served them: both workers serve both instances
    assert wm["cross_node_hits"] > 0 and wm["local_hits"] > 0
    assert wm["cross_node_hits"] + wm["local_hits"] == round(wm["hit_rate"] * wm["gets"])
    assert rm["hits"] > 0 and rm["wrong_blocks"] == 0 and rm["cross_node_hits"] > 0
    # notifications: every batch the writer created was announced; the reader got them and read them
    assert wm["notifications_sent"] > 0
    assert rm["notifications"] > 0 and rm["notified_keys"] >= rm["notifications"]
    assert rm["notified_gets"] > 0 and rm["notified_hits"] == rm["notified_gets"]
    assert rm["notify_p50_ms"] >= 0
    for i in (0, 1):  # each worker's SSD tier lives in its instance's store folder
        assert (tmp_path / f"rocksdb{i}" / "data.mdb").exists()
    print(json.dumps({"writer": wm, "reader": rm}))  # the walkthrough's figures, with -s
    with (tmp_path / "reader.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["op"] for row in rows] == ["get"]
    assert int(rows[0]["count"]) == rm["ops"] and int(rows[0]["fail"]) == 0
    assert float(rows[0]["p50_ms"]) <= float(rows[0]["p99_ms"]) <= float(rows[0]["max_ms"])
