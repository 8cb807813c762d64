"""A worker's own lifecycle: failed starts release everything, accept errors never end service, and a
restart on the same state keeps its id (so its SSD blocks are served where placement looks for them)."""
from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.errors import PoolUnavailable
from kvpool.core.nats_server import free_port
from kvpool.core.procs import WorkerProcess
from kvpool.core.tiers.dram import arena_names

from faulthelp import block, poll, read_all, wait_members, worker_id

SIZE = 16 << 10
SMALL = {"KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "0"}


def _worker_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "kvpool.core.cli", "worker", "--dram-bytes", "64MiB", *extra]


@pytest.mark.parametrize("why", ["port in use", "metrics port in use", "nats unreachable"])
def test_a_worker_that_cannot_start_leaves_no_arena(tmp_path: Path, why: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        taken = str(busy.getsockname()[1])
        args = {"port in use": ["--port", taken],
                "metrics port in use": ["--port", "0", "--metrics-port", taken],
                "nats unreachable": ["--port", "0", "--nats-url", f"nats://127.0.0.1:{free_port()}"]}[why]
        env = {**os.environ, **SMALL, "KVPOOL_STATE_DIR": str(tmp_path), "KVPOOL_PREFAULT": "1"}
        proc = subprocess.Popen(_worker_cmd(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out
    assert arena_names(proc.pid) == set(), f"{why}: the failed worker left its arena"
    assert not list(tmp_path.glob("*.sock")), "the failed worker left its socket"


def test_accept_errors_back_off_and_service_resumes(tmp_path: Path) -> None:
    """Out of file descriptors: the worker keeps its listener, logs the error once, and serves again
    once descriptors are free (it used to stop accepting for good)."""
    port = free_port()
    log_path = tmp_path / "worker.log"

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    env = {**os.environ, **SMALL, "KVPOOL_STATE_DIR": str(tmp_path)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_worker_cmd("--port", str(port)), env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=low_fd_limit)
    hogs: list[socket.socket] = []
    try:
        assert poll(lambda: _serves(port), 30), "the worker did not start"
        with PoolClient(mode="local", worker=f"127.0.0.1:{port}", timeout_s=10) as probe:
            probe.put("before", b"x")
        for _ in range(80):  # far more connections than the worker has descriptors for
            hogs.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        assert not _serves(port), "the worker still had descriptors: the test proves nothing"
    finally:
        for h in hogs:
            h.close()
    try:
        with PoolClient(mode="local", worker=f"127.0.0.1:{port}", timeout_s=10) as c:
            c.put("after", b"y")
            assert c.get("before") == b"x" and c.get("after") == b"y"
        text = log_path.read_text(errors="replace")
        assert text.count("cannot accept tcp connections") == 1, text[-3000:]
    finally:
        proc.terminate()
        proc.wait(20)


def _serves(port: int) -> bool:
    try:
        with PoolClient(mode="local", worker=f"127.0.0.1:{port}", timeout_s=2) as c:
            return c.batch_exists(["probe"]) == [False]
    except PoolUnavailable:
        return False


TTL = {"KVPOOL_MEMBER_TTL_S": "3", "KVPOOL_HEARTBEAT_S": "1"}
"""A short member TTL: a worker back on its kept blocks serves them as misses for that long (`Worker._settle`)."""


def _ssd_worker(nats, tmp_path: Path, i: int) -> WorkerProcess:
    """Worker `i` of a test, with an SSD tier on its own state folder (the same one again on a restart)."""
    return WorkerProcess(tmp_path / f"w{i}", nats_url=nats.url, ssd=True, dram_bytes="64MiB", env={**SMALL, **TTL})


def _restart(c: PoolClient, nats, tmp_path: Path, workers: list[WorkerProcess], i: int, keys: Iterable[str]) -> None:
    """SIGTERM worker `i` (its DRAM is flushed to its SSD tier), start it again on the same state, and wait
    until `c` sees the new process's entry (its view may still hold the old one's) and the worker serves
    what it kept (one of `keys`: after its second catch-up, a member TTL on)."""
    wid = worker_id(workers[i])
    old = c.backend.members()[wid].incarnation
    assert workers[i].stop() == 0
    workers[i] = _ssd_worker(nats, tmp_path, i).wait_ready()
    assert worker_id(workers[i]) == wid
    assert c.wait_for_members(lambda m: wid in m and m[wid].incarnation != old and len(m) == len(workers), 15)
    names = list(keys)
    with PoolClient(mode="local", worker=workers[i].address, timeout_s=5) as direct:
        until = time.monotonic() + 20
        while not any(direct.batch_exists(names)):
            assert time.monotonic() < until, "the restarted worker never served what it kept"
            time.sleep(0.2)


@contextmanager
def _ssd_workers(nats, tmp_path: Path, n: int) -> Iterator[list[WorkerProcess]]:
    """`n` SSD workers, ready; stopped at the end (those `_restart` put in their places too)."""
    workers = [_ssd_worker(nats, tmp_path, i) for i in range(n)]
    try:
        for w in workers:
            w.wait_ready()
        yield workers
    finally:
        for w in workers:
            w.stop(timeout=5)


def test_a_failure_on_a_restarted_workers_old_process_leaves_the_new_one_askable(nats, tmp_path: Path) -> None:
    """A call that took the member list before a worker restarted (a cluster client's background job: its
    notes to the workers next in line, its read repairs) fails on the old process: that process is
    suspect, not the one now serving under the same id, whose blocks are read at once."""
    with _ssd_workers(nats, tmp_path, 2) as workers:
        restarted = worker_id(workers[1])
        keys = {f"s{i}": SIZE for i in range(200)}
        with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as c:
            wait_members(c, 2)
            c.batch_put(list(keys), [block(k, SIZE) for k in keys])
            before = dict(c.backend.members())
            _restart(c, nats, tmp_path, workers, 1, keys)
            late = c.backend.fanout.each(before, {restarted: [0]}, lambda t, idx: t.batch_exists([b"s0"]),
                                         time.monotonic() + 5)
            assert list(late) == []  # it failed on the old process
            hits, misses = read_all(c, keys)
        assert not misses, f"{len(misses)} of {len(keys)} blocks missed: the restarted worker was taken as down"


def test_a_background_job_queued_before_a_restart_reaches_the_new_process(nats, tmp_path: Path) -> None:
    """A put's notes to the workers next in line wait in the client's background queue while a worker
    restarts: they go to the member as it is when they are sent, so the client's connection to the new
    process stays (sent with the list of their put, they would have replaced it by one to the old process,
    closing it under any call in flight on it)."""
    gate = threading.Event()
    with _ssd_workers(nats, tmp_path, 2) as workers, PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as c:
        try:
            restarted = worker_id(workers[1])
            keys = {f"q{i}": SIZE for i in range(100)}
            wait_members(c, 2)
            queue = c.backend.supersedes
            assert queue.submit(1, gate.wait)  # the notes queue up behind this
            c.batch_put(list(keys), [block(k, SIZE) for k in keys])
            _restart(c, nats, tmp_path, workers, 1, keys)
            hits, misses = read_all(c, keys)  # through a connection to the new process
            assert not misses
            held = c.backend.fanout._transports[restarted]
            gate.set()
            queue.wait()
            assert c.backend.fanout._transports.get(restarted) is held
        finally:
            gate.set()


def test_restart_on_the_same_state_keeps_its_id_and_serves_its_blocks(nats, tmp_path: Path) -> None:
    with _ssd_workers(nats, tmp_path, 3) as workers:
        keys = {f"r{i}": SIZE for i in range(600)}
        with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as c:
            wait_members(c, 3)
            names = list(keys)
            for i in range(0, len(names), 50):
                c.batch_put(names[i:i + 50], [block(k, SIZE) for k in names[i:i + 50]])
            _restart(c, nats, tmp_path, workers, 1, keys)  # keeps its id
            hits, misses = read_all(c, keys)
        assert not misses, f"{len(misses)} of {len(keys)} blocks missed after a restart on the same state"


def test_worker_id_flag_names_the_worker(tmp_path: Path) -> None:
    w = WorkerProcess(tmp_path / "w", extra=["--worker-id", "rack1-w7"], dram_bytes="64MiB", env=SMALL).wait_ready()
    try:
        assert worker_id(w) == "rack1-w7"
    finally:
        w.stop()


_STARTER = """
import sys, time
from kvpool.core.procs import WorkerProcess
w = WorkerProcess(sys.argv[1], dram_bytes="64MiB", env={"KVPOOL_DRAM_SLAB_SIZE": "1MiB"}).wait_ready()
print(w.proc.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_whose_starter_was_killed_stops_and_unlinks_its_arena(tmp_path: Path) -> None:
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        assert starter.stdout is not None
        pid = int(starter.stdout.readline())
        assert _running(pid) and arena_names(pid)
        starter.kill()  # kill -9: the starter's WorkerProcess never stops the worker
        starter.wait()
        assert poll(lambda: not _running(pid), 10), "the orphaned worker is still running"
        assert not arena_names(pid)  # it stopped as on SIGTERM: its arena is gone with it
    finally:
        starter.kill()
        starter.wait()
        if starter.stdout is not None:
            starter.stdout.close()
        if pid and _running(pid):
            os.kill(pid, 9)
            for name in arena_names(pid):
                os.unlink(f"/dev/shm/{name}")


def _live_thread_names() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvpool-accept"))


def test_an_in_process_worker_that_stops_frees_its_ports_and_threads(tmp_path: Path) -> None:
    from kvpool.core.config import CacheConfig, WorkerConfig
    from kvpool.core.server import Worker

    cache = CacheConfig(dram_bytes=16 << 20, dram_slab_size=4 << 20, prefault=False)
    metrics_port = free_port()
    ports = []
    for i in range(3):  # the same metrics port each time: free again once the last worker stopped
        w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / f"w{i}.sock"), metrics_port=metrics_port),
                   cache).start()
        with PoolClient(mode="local", worker=w.unix_path, timeout_s=5) as c:
            c.put("k", b"x" * 100)
        ports.append(w.port)
        w.stop()
    assert _live_thread_names() == []  # accept loops end with stop (a close alone leaves accept() blocked)
    for port in [*ports, metrics_port]:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_an_in_process_worker_that_cannot_start_frees_its_metrics_port(tmp_path: Path) -> None:
    from kvpool.core.config import CacheConfig, WorkerConfig
    from kvpool.core.server import Worker

    cache = CacheConfig(dram_bytes=16 << 20, dram_slab_size=4 << 20, prefault=False)
    metrics_port = free_port()
    cfg = WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), metrics_port=metrics_port,
                       nats_url=f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(PoolUnavailable):
        Worker(cfg, cache).start()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", metrics_port), timeout=2).close()


def test_a_hangup_stops_a_worker_as_cleanly_as_sigterm(tmp_path: Path) -> None:
    """The terminal or ssh session it ran in went away: DRAM flushed to SSD, the arena unlinked."""
    w = WorkerProcess(tmp_path, dram_bytes="64MiB", ssd=True, env={"KVPOOL_DRAM_SLAB_SIZE": "1MiB"}).wait_ready()
    pid = w.proc.pid
    with PoolClient(mode="local", worker=w.unix_path) as c:
        c.put("kept", block("kept", SIZE))
    os.kill(pid, signal.SIGHUP)
    assert w.proc.wait(30) == 0
    w.stop()  # (closes its log)
    assert not arena_names(pid)
    again = WorkerProcess(tmp_path, dram_bytes="64MiB", ssd=True, env={"KVPOOL_DRAM_SLAB_SIZE": "1MiB"}).wait_ready()
    try:
        with PoolClient(mode="local", worker=again.unix_path) as c:
            assert c.get("kept") == block("kept", SIZE)  # flushed to SSD before it stopped
    finally:
        again.stop()


_NATS_STARTER = """
import sys, time
from kvpool.core.nats_server import NatsServer
s = NatsServer(sys.argv[1], port=0).start()
print(s.proc.pid, s.port, flush=True)
time.sleep(600)
"""


def test_a_nats_server_dies_with_the_process_that_started_it_and_its_port_is_not_adopted(tmp_path: Path) -> None:
    from kvpool.core.errors import ListenError
    from kvpool.core.nats_server import NatsServer

    starter = subprocess.Popen([sys.executable, "-c", _NATS_STARTER, str(tmp_path / "a")], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert starter.stdout is not None
        pid, port = map(int, starter.stdout.readline().split())
        with pytest.raises(ListenError, match="already listens"):  # the live one's port: refused, not adopted
            NatsServer(tmp_path / "b", port=port).start()
        starter.kill()  # kill -9: nothing in the starter stops its nats-server
        starter.wait()
        assert poll(lambda: not _running(pid), 10), "the nats-server outlived the process that started it"
    finally:
        starter.kill()
        starter.wait()
        if starter.stdout is not None:
            starter.stdout.close()


def test_a_nats_server_started_from_a_thread_outlives_the_thread(tmp_path: Path) -> None:
    """The parent-death signal comes when the thread that forked ends: armed only from the main thread."""
    import threading

    from kvpool.core.nats_server import NatsServer

    started: list[NatsServer] = []
    t = threading.Thread(target=lambda: started.append(NatsServer(tmp_path / "n", port=0).start()))
    t.start()
    t.join(30)
    try:
        assert started and started[0].proc is not None
        time.sleep(1.0)
        assert started[0].proc.poll() is None, "the server died with the thread that started it"
    finally:
        for s in started:
            s.stop()


def test_a_second_worker_on_the_same_ssd_folder_is_refused(tmp_path: Path) -> None:
    """Two workers on one SSD folder would evict and overwrite each other's blocks behind their backs
    and register under one worker id (a client then read older acknowledged versions): the second
    start fails, naming the folder's holder, and the first serves on."""
    ssd = tmp_path / "ssd"
    env = {**os.environ, **SMALL, "KVPOOL_STATE_DIR": str(tmp_path / "a")}
    first = subprocess.Popen(_worker_cmd("--port", "0", "--ssd-path", str(ssd)), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert poll(lambda: (ssd / "kvpool.lock").exists() and (ssd / "data.mdb").exists(), 30)
        second = subprocess.run(_worker_cmd("--port", "0", "--ssd-path", str(ssd)),
                                env={**env, "KVPOOL_STATE_DIR": str(tmp_path / "b")}, capture_output=True,
                                text=True, timeout=60)
        assert second.returncode != 0
        assert f"the SSD tier at {ssd} is in use by another process (pid {first.pid})" in second.stderr, \
            second.stderr[-2000:]
        assert "Traceback" not in second.stderr
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(30)
    again = subprocess.Popen(_worker_cmd("--port", "0", "--ssd-path", str(ssd)), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # the lock went with its holder: the folder is free again
        assert poll(lambda: (ssd / "kvpool.lock").read_text().strip() == str(again.pid), 30)
    finally:
        again.terminate()
        again.wait(30)


def _no_file_writes() -> None:
    """In the child: every write to a file fails (EFBIG), as on a full disk."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


@pytest.mark.parametrize("where", ["a file in the way", "writes failing"])
def test_an_unusable_ssd_folder_is_a_clear_error_at_start(tmp_path: Path, where: str) -> None:
    """A file where the SSD folder should be, or a disk that takes no writes: a typed error naming the
    folder (no traceback), and no temporary file left behind."""
    if where == "a file in the way":
        (tmp_path / "blocker").write_text("not a folder")
        ssd = tmp_path / "blocker" / "ssd"
    else:
        ssd = tmp_path / "ssd"
    env = {**os.environ, **SMALL, "KVPOOL_STATE_DIR": str(tmp_path / "state"), "KVPOOL_TOKEN": "t" * 32}
    proc = subprocess.run(_worker_cmd("--port", "0", "--ssd-path", str(ssd)), env=env, capture_output=True,
                          text=True, timeout=60, preexec_fn=_no_file_writes if where == "writes failing" else None)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and str(ssd) in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.rglob("*.tmp*")), "a failed start left a temporary file"


def test_a_token_file_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, **SMALL, "KVPOOL_STATE_DIR": str(tmp_path / "state")}
    env.pop("KVPOOL_TOKEN", None)
    proc = subprocess.run(_worker_cmd("--port", "0"), env=env, capture_output=True, text=True, timeout=60,
                          preexec_fn=_no_file_writes)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "cannot create the token file" in proc.stderr, proc.stderr[-2000:]
    assert not [p for p in tmp_path.rglob("*") if "token" in p.name], "a failed start left a token file"
