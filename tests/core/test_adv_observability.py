"""Adversarial checks of a worker's observability and long-run hygiene: its Prometheus endpoint, the
cache counters it exports (`kvpool_cache_*`, `kvpool status`), and what strangers can make it hold."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvpool.backends.fastdeploy import KVPoolStore
from kvpool.core import PoolClient, TieredCache
from kvpool.core.blocks import checksum
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import AuthError, NamespaceError
from kvpool.core.nats_server import NatsServer, free_port
from kvpool.core.procs import WorkerProcess
from kvpool.core.server import Worker

from corehelp import KiB, payload


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the peer closes `s` (EOF or reset) within 10 s."""
    s.settimeout(10)
    try:
        return s.recv(4096) == b""
    except ConnectionError:
        return True


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


# Bug: the metrics port (prometheus_client's thread-per-connection server: no read deadline, no bound) lets
# any stranger who reaches it hold one worker thread and one fd per idle connection for ever (until the
# worker's fds run out: then it cannot accept clients, and the metrics thread spins on EMFILE); the
# worker's own port closes a stranger after auth_timeout_s "so strangers cannot hold the worker's threads".
def test_idle_connections_to_the_metrics_port_do_not_hold_worker_threads(
        spawn: Callable[..., WorkerProcess]) -> None:
    port = free_port()
    w = spawn(extra=["--metrics-port", str(port)], env={"KVPOOL_AUTH_TIMEOUT_S": "2"})
    assert "kvpool_connections" in _scrape(port)
    base = _threads(w.proc.pid)
    strangers = []
    try:
        for _ in range(24):  # connect, never send a byte (a port scan, a stuck scraper, an attacker)
            strangers.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.5)
        assert "kvpool_connections" in _scrape(port)  # a scraper still gets through the crowd
        deadline = time.monotonic() + 13  # auth_timeout_s (2 s), or a fixed 10 s read deadline, and slack
        while _threads(w.proc.pid) > base + 2 and time.monotonic() < deadline:
            time.sleep(0.25)
        held = _threads(w.proc.pid) - base
        assert held <= 2, (f"{len(strangers)} idle connections to the metrics port still hold {held} worker "
                           "threads (and as many fds) 13 s after connecting")
        assert "kvpool_connections" in _scrape(port)
    finally:
        for s in strangers:
            s.close()


# Bug: a DRAM block committed unchecked (check_puts="first_read", a handoff's layers, verify_dram_reads)
# whose bytes fail their checksum at the read is counted as a DRAM hit (tier_moves.acquire_many counts
# hits before it verifies them) and then as a miss: one lookup counted twice, the hit rate inflated.
def test_a_block_that_fails_its_first_read_check_is_one_miss_not_a_hit_too(
        make_cache: Callable[..., TieredCache]) -> None:
    cache = make_cache()
    data = payload("bad", 64 * KiB)
    (off,) = cache.reserve_many([len(data)])
    assert off is not None
    cache.arena.view(off, len(data))[:] = data
    assert cache.commit_many([b"bad"], [off], [len(data)], [checksum(data) ^ 1], checked=False) == [True]
    assert cache.get(b"bad") is None  # one lookup, a miss
    s = cache.stats()
    assert s.checksum_failures == 1
    assert (s.hits_dram, s.hits_ssd, s.misses) == (0, 0, 1), \
        f"one failed read counted as {s.hits_dram} DRAM hit(s) and {s.misses} miss(es)"


def _sample(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in a scrape (0 if the series is not there yet)."""
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


# Bug: a TCP stranger that sends nothing is closed by its socket's timeout (settimeout(auth_timeout_s) in
# worker_serving._admit), which raises TimeoutError into _serve's silent `except (ConnectionError, OSError)`
# before the watchdog sees it late: kvpool_deadline_closes_total{deadline="auth"} never counts the most
# common auth-deadline close (its help: "auth: not authenticated in time"), nor is it logged.
def test_strangers_closed_for_the_auth_deadline_are_counted(spawn: Callable[..., WorkerProcess]) -> None:
    port = free_port()
    w = spawn(extra=["--metrics-port", str(port)], env={"KVPOOL_AUTH_TIMEOUT_S": "2"})
    strangers = [socket.create_connection(("127.0.0.1", w.port), timeout=10) for _ in range(4)]
    try:
        for s in strangers:  # each is closed by the worker (EOF) once its auth deadline passed
            assert _closed_by_peer(s)
    finally:
        for s in strangers:
            s.close()
    time.sleep(0.5)
    closes = _sample(_scrape(port), "kvpool_deadline_closes_total", 'deadline="auth"')
    assert closes == 4, f"4 strangers closed for not authenticating in time; kvpool_deadline_closes counted {closes}"


# Bug: the client treats NamespaceError (an AuthError) like a failed login and drops its connection
# (connection.py `except (AuthError, PoolUnavailable): self.close()`), so each refused request comes on a
# fresh connection (HELLO + AUTH again) and the worker's "logged once per connection" warning is logged
# once per refused request: a tenant's client naming an outside key in a loop floods the worker's log.
def test_a_tenants_refused_requests_are_logged_once_not_per_request(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"a": {"token": "tenant-a-token-" + "a" * 32}}))
    tenants.chmod(0o600)
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), token="pool-token-" + "p" * 40,
                            tenants_file=str(tenants)),
               CacheConfig(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)).start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvpool"), \
                PoolClient(mode="local", worker=w.address, token="tenant-a-token-" + "a" * 32, timeout_s=5) as c:
            c.put("a/mine", b"x" * 100)
            for _ in range(50):
                with pytest.raises(NamespaceError):
                    c.get("b/theirs")
            assert c.get("a/mine") == b"x" * 100
        logged = [r for r in caplog.records if "outside its namespace" in r.getMessage()]
        text = generate_latest(w.metrics.registry).decode()
        assert _sample(text, "kvpool_tenant_refusals_total", 'tenant="a",why="namespace"') == 50
        logins = _sample(text, "kvpool_ops_total", 'op="auth"')
        assert len(logged) <= 1, (f"one client's 50 refused requests logged {len(logged)} warnings "
                                  f"(it logged in {logins:.0f} times)")
    finally:
        w.stop()


def _token_worker(tmp_path: Path) -> Worker:
    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), token="pool-token-" + "p" * 40),
                  CacheConfig(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)).start()


def _wrong_token(w: Worker) -> None:
    """One client's attempt with a wrong token: AuthError."""
    c = PoolClient(mode="local", worker=w.address, token="a-wrong-token-" + "w" * 30, timeout_s=10)
    try:
        with pytest.raises(AuthError):
            c.get("k")
    finally:
        c.close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


# Bug: README "Worker access": a wrong token's source "first failure is a warning, one a minute at most
# (the rest at debug level)". AuthThrottle keeps to that, but the failed AUTH then raises ProtocolError
# and worker_serving._serve logs `closing tcp connection: authentication failed ...` as a WARNING for every
# attempt: a token guesser writes one warning line per guess.
def test_wrong_tokens_from_one_source_are_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    w = _token_worker(tmp_path)
    try:
        with caplog.at_level(logging.DEBUG, logger="kvpool"):
            for _ in range(5):
                _wrong_token(w)
        text = generate_latest(w.metrics.registry).decode()
        assert _sample(text, "kvpool_auth_failures_total", 'kind="token"') == 5
        logged = _warnings(caplog)
        assert len(logged) <= 1, f"5 wrong tokens from one source logged {len(logged)} warnings: {logged}"
    finally:
        w.stop()


# Bug: kvpool_protocol_errors_total is "Connections closed for malformed frames", but a well-formed AUTH
# with a wrong token is counted there too (it raises ProtocolError into _serve's counting except), so a
# dashboard's "protocol errors" series shows token guessing (already in kvpool_auth_failures_total).
def test_a_wrong_token_is_not_a_protocol_error(tmp_path: Path) -> None:
    w = _token_worker(tmp_path)
    try:
        for _ in range(3):
            _wrong_token(w)
        time.sleep(0.2)
        text = generate_latest(w.metrics.registry).decode()
        assert _sample(text, "kvpool_auth_failures_total", 'kind="token"') == 3
        assert _sample(text, "kvpool_protocol_errors_total") == 0, "well-formed AUTHs counted as malformed frames"
    finally:
        w.stop()


# Bug: any peer that reaches the TCP port, without a token, gets one WARNING line per connection for
# whatever it sends (an HTTP health check, a port scanner, garbage: "closing tcp connection: bad magic";
# a request before AUTH: "unauthenticated op"): worker_serving._serve logs every ProtocolError at warning
# level; SparseLog ("a crowd of strangers ... must not flood its log") is used only for watchdog closes.
def test_strangers_sending_garbage_cannot_flood_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    w = _token_worker(tmp_path)
    try:
        with caplog.at_level(logging.DEBUG, logger="kvpool"):
            for _ in range(30):
                with socket.create_connection(("127.0.0.1", w.port), timeout=10) as s:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: worker\r\n\r\n" + bytes(64))
                    assert _closed_by_peer(s)
            time.sleep(0.2)
        logged = _warnings(caplog)
        assert len(logged) <= 2, f"30 strangers' connections logged {len(logged)} warnings, e.g. {logged[:2]}"
        with PoolClient(mode="local", worker=w.address, token="pool-token-" + "p" * 40, timeout_s=10) as c:
            c.put("k", b"v")  # the worker is fine
            assert c.get("k") == b"v"
    finally:
        w.stop()


# Bug: with one of two cluster workers dead, an adapter's single-key put whose owner is the dead worker
# raises PoolUnavailable (not PartialPut), which HostIO (backends/_hostio.py `_failed`) takes for a pool
# outage: a "kvpool unavailable" warning, then for retry_s every call, the healthy worker's keys
# included, is answered RPC_FAIL without asking; the next put that succeeds logs "reachable again", and
# the next one to the dead worker's keys a new outage. The README promises the outage "logged once" and
# that "in a cluster, a worker that stops answering fails only the keys it owns".
def test_one_dead_worker_of_two_is_not_a_flapping_pool_outage(nats: NatsServer, spawn: Callable[..., WorkerProcess],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    workers = [spawn(nats_url=nats.url, node_id=f"n{i}") for i in range(2)]
    store = KVPoolStore("m", mode="cluster", nats_url=nats.url, timeout_s=1.0, node_id="client", retry_s=0.2)
    buf = np.zeros(4096, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    try:
        assert store._io.call(lambda c: c.wait_for_members(lambda m: len(m) == 2, 10), lambda st: False)
        assert store.batch_set(["warm"], [buf.ctypes.data], [4096]) == [0]
        workers[1].kill()  # still a member (suspect) for the 10 s of its entry's TTL: its keys fail
        stored = calls = 0
        with caplog.at_level(logging.DEBUG, logger="kvpool"):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 4:
                stored += store.batch_set([f"key{calls}"], [buf.ctypes.data], [4096]) == [0]
                calls += 1
                time.sleep(0.01)
        outages = [r for r in caplog.records if "kvpool unavailable" in r.getMessage()]
        assert len(outages) <= 1, (f"{len(outages)} 'kvpool unavailable' warnings in 4 s; {stored} of {calls} "
                                   "single-key puts stored while the healthy worker owns about half the keys")
        assert stored >= calls // 4, f"only {stored} of {calls} puts stored: the healthy worker's keys fail too"
    finally:
        store.close()


# Bug: WorkerConfig says a port of 0 (metrics_port included) is "any free one", but nothing tells which
# port the metrics got: the ready line and the start log name the TCP port and the socket only, and the
# Worker has no public attribute for it, so `--metrics-port 0` serves metrics nobody can find.
def test_a_metrics_port_of_0_is_told(spawn: Callable[..., WorkerProcess]) -> None:
    w = spawn(extra=["--metrics-port", "0"])
    told = {int(p) for p in re.findall(r"\b(\d{4,5})\b", w.log_tail(1 << 16))} - {w.port}
    served = []
    for port in sorted(told):
        try:
            if "kvpool_connections" in _scrape(port):
                served.append(port)
        except OSError:
            pass
    assert served, f"the worker's output names no port that serves /metrics: {w.log_tail(1500)}"


def _ops(port: int) -> dict[str, float]:
    text = _scrape(port)
    return {op: _sample(text, "kvpool_ops_total", f'op="{op}"') for op in ("lease", "release", "get")}


# Bug: a same-node `get` (transport.ShmTransport.batch_lease) sends two LEASE requests: its
# loop over the keys past MAX_LEASES (`rest`, empty) runs once anyway, since protocol.frames(0) returns
# [slice(0, 0)], and leases zero keys in a round trip of its own. Every same-node get pays an extra
# request, and kvpool_ops_total{op="lease"} counts two per get.
def test_a_same_node_get_is_one_lease_request(spawn: Callable[..., WorkerProcess]) -> None:
    port = free_port()
    w = spawn(extra=["--metrics-port", str(port)])
    with PoolClient(mode="local", worker=w.unix_path, timeout_s=10) as c:
        c.put("k", b"x" * 1000)
        before = _ops(port)
        for _ in range(10):
            assert c.get("k") == b"x" * 1000
        for _ in range(10):
            assert c.get("absent") is None
    # (the worker counts a request once it has answered it: the last may be counted a moment later)
    deadline = time.monotonic() + 5
    while _ops(port)["lease"] - before["lease"] < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    leases = _ops(port)["lease"] - before["lease"]
    assert leases == 20, f"20 same-node gets sent {leases:.0f} LEASE requests"
