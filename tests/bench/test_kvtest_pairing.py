"""kvtest's two instances against what a user already runs, and pairings that fail: instances join the
authenticated nats-server of a `kvpool up` with the user's own credentials (or stop at once, saying
what to do, when there are none); a reader whose writer failed, or that received none of the
announcements its writer sent, exits non-zero, and so does its writer; no lock file is left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.core.bench import kvtest_instance
from kvpool.core.client import PoolClient
from kvpool.core.config import default_state_dir
from kvpool.core.nats_creds import authorization, creds_dir, creds_path, ensure_creds
from kvpool.core.nats_server import NatsServer, free_port
from kvpool.core.procs import WorkerProcess

from benchhelp import Ran

SEED_TEST = {"test_mode": "cache", "key_pool_size": 10000, "inference_delay_ms": 100, "hit_rate": 0.8}
SIZING = ["--block-size", "64KiB", "--dram-bytes", "64MiB"]


class Up:
    """What `kvpool up` leaves running: an nats-server with a user per role (credentials in the state
    dir, `KVPOOL_STATE_DIR`) and a worker registered with the worker role's."""

    def __init__(self, state: Path, nats: NatsServer, worker: WorkerProcess) -> None:
        self.state, self.nats, self.worker = state, nats, worker


@pytest.fixture
def up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spawn: Callable[..., WorkerProcess]) -> Iterator[Up]:
    state = tmp_path / "state"
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(state))
    where = creds_dir()  # <state>/nats, as `kvpool up` lays it out (core/cli.py cmd_up)
    nats = NatsServer(where, port=free_port(), authorization=authorization(ensure_creds(where))).start()
    try:
        worker = spawn(nats_url=nats.url, extra=["--nats-creds", str(creds_path("worker"))])
        yield Up(state, nats, worker)
    finally:
        nats.stop()


def _configs(tmp_path: Path) -> tuple[int, int]:
    """The walkthrough's three config files (on free ports instead of 8080/8081); the two ports."""
    p0, p1 = free_port(), free_port()
    for name, i, port, peer in (("writer0.json", 0, p0, p1), ("reader1.json", 1, p1, p0)):
        (tmp_path / name).write_text(json.dumps({"instance_id": i, "listen_port": port,
                                                 "rocksdb_store_dir": f"./rocksdb{i}",
                                                 "remote_worker": f"127.0.0.1:{peer}"}))
    (tmp_path / "cache.json").write_text(json.dumps(SEED_TEST))
    return p0, p1


def _start(cwd: Path, role: str, duration: int, *argv: str, env: dict[str, str] | None = None
           ) -> subprocess.Popen[str]:
    config = "writer0.json" if role == "writer" else "reader1.json"
    return subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "bench", "cache", "--json", "--config", config,
                             "--config", "cache.json", "--role", role, "--duration", str(duration), *SIZING, *argv],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _done(proc: subprocess.Popen[str]) -> Ran:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return Ran(proc.returncode, out, err)


def _lock(port: int) -> Path:
    return default_state_dir() / f"kvpool-kvtest-nats-{port}.lock"  # (the instances' own: they inherit the env)


def test_instances_join_the_authenticated_nats_of_kvpool_up(up: Up, tmp_path: Path) -> None:
    _configs(tmp_path)
    cluster = ["--cluster", up.nats.url]
    writer = _start(tmp_path, "writer", 8, *cluster)
    reader = _start(tmp_path, "reader", 4, *cluster)
    r, w = _done(reader), _done(writer)
    assert w.rc == 0, w.err[-3000:]
    assert r.rc == 0, r.err[-3000:]
    wm, rm = w.json["metrics"], r.json["metrics"]
    assert wm["pairing"] == rm["pairing"] == "ok"
    assert rm["hits"] > 0 and rm["wrong_blocks"] == 0
    # the writer published on the notification stream (its bench client is not the worker role) and
    # the reader received its announcements
    assert wm["notifications_sent"] > 0 and rm["notifications"] > 0
    assert "AuthError" not in w.err + r.err


def test_no_credentials_for_an_authenticated_nats_stop_the_run_at_once(
        up: Up, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bench: Callable[..., Ran]) -> None:
    _configs(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "another-state"))  # not the one `kvpool up` keeps
    ran = bench("cache", "--config", "writer0.json", "--config", "cache.json", "--role", "writer", "--duration", "5",
                "--cluster", up.nats.url, *SIZING)
    assert ran.rc == 2, ran.err
    assert "requires credentials" in ran.err and str(tmp_path / "another-state" / "nats") in ran.err
    assert "stop that `kvpool up`" in ran.err and "nats_url" in ran.err
    assert "AuthError" not in ran.err and "Traceback" not in ran.err
    assert not (tmp_path / "rocksdb0").exists()  # no worker was started


def test_a_reader_whose_writer_failed_exits_non_zero(up: Up, tmp_path: Path,
                                                     spawn: Callable[..., WorkerProcess]) -> None:
    """The walkthrough as first found failing: the writer's bench client has only the worker role's
    credentials (KVPOOL_NATS_CREDS), which may neither configure its announcements' stream nor publish
to it, so it fails before its first;
    the reader finds the window an earlier writer left in the pool and reads it to its end. (Both
    instances join workers already serving on their ports, so the pool's members, and where that
    window lives, stay put.)"""
    p0, p1 = _configs(tmp_path)
    for i, port in ((0, p0), (1, p1)):
        spawn(nats_url=up.nats.url, port=port, node_id=f"kvtest-{i}",
              extra=["--worker-id", f"kvtest-{i}", "--nats-creds", str(creds_path("worker"))])
    with PoolClient(mode="cluster", nats_url=up.nats.url) as client:
        assert client.wait_for_members(lambda m: len(m) >= 3, 15)
        client.put("kvpool-bench/window", json.dumps({"run": "earlier", "lo": 0, "hi": 64, "block_size": 64 << 10,
                                                      "sizes": [64 << 10]}).encode())
    cluster = ["--cluster", up.nats.url]
    writer = _start(tmp_path, "writer", 8, *cluster, env={"KVPOOL_NATS_CREDS": str(creds_path("worker"))})
    reader = _start(tmp_path, "reader", 3, *cluster)
    r, w = _done(reader), _done(writer)
    assert w.rc == 2 and "may not" in w.err and "KVPOOL_NATS_CREDS" in w.err, w.err[-3000:]
    assert r.rc == 1, r.err[-3000:]
    assert "pairing failed" in r.err and "kvtest-0" in r.err and "may not" in r.err, r.err[-3000:]
    assert r.json["metrics"]["pairing"] == "failed"


def test_a_reader_that_receives_no_announcement_fails_and_so_does_its_writer(tmp_path: Path) -> None:
    """The writer announces, but the reader takes none of its announcements (it requires signed ones:
    KVPOOL_STREAM_SECRET): both exit 1, the reader saying what it missed. The first instance starts the
    nats-server, and leaves no lock file of it."""
    _configs(tmp_path)
    port = free_port()
    cluster = ["--cluster", f"nats://127.0.0.1:{port}"]
    writer = _start(tmp_path, "writer", 8, *cluster)
    reader = _start(tmp_path, "reader", 3, *cluster, env={"KVPOOL_STREAM_SECRET": "the writer does not sign"})
    r, w = _done(reader), _done(writer)
    assert r.rc == 1, r.err[-3000:]
    assert "no announcement arrived" in r.err and r.json["metrics"]["notifications"] == 0, r.err[-3000:]
    assert r.json["metrics"]["wrong_blocks"] == 0
    assert w.rc == 1, w.err[-3000:]
    assert "pairing failed" in w.err and "no announcement arrived" in w.err, w.err[-3000:]
    assert w.json["metrics"]["notifications_sent"] > 0
    assert not _lock(port).exists()


def test_the_nats_start_lock_excludes_and_is_not_left_behind() -> None:
    port = free_port()
    inside, most, errors = [0], [0], []
    guard = threading.Lock()
    start = threading.Barrier(8)

    def take() -> None:
        try:
            start.wait()
            for _ in range(20):
                with kvtest_instance._port_lock(port):
                    with guard:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                    time.sleep(0.001)  # (another holder would be inside meanwhile)
                    with guard:
                        inside[0] -= 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert most[0] == 1
    assert not _lock(port).exists()
