"""Review of the fixes 10fc4f0, c552f66, 089abd5 and 0c37616 (clients under threads/fork, frames(0),
observability, remove_as_of): what they got wrong or left."""
from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.errors import PoolUnavailable
from kvpool.core.fanout import SUSPECT_S
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess

from faulthelp import wait_members


# Bug: a cluster put while EVERY worker is down (killed, still members for their entry's TTL) raises
# PartialPut, not PoolUnavailable: cluster_backend._put_as_of takes "a member that owns none of the
# blocks" for "other workers answer" (README: PartialPut "while other workers answer"), so the adapters
# (HostIO) start no outage and log "kvpool reachable again" on a pool nobody answers from.
def test_a_put_while_every_worker_is_down_is_an_outage_not_a_partial_put(nats: NatsServer,
                                                                        spawn: Callable[..., WorkerProcess]) -> None:
    workers = [spawn(nats_url=nats.url, node_id=f"n{i}") for i in range(2)]
    pool = PoolClient(mode="cluster", nats_url=nats.url, timeout_s=1.0, node_id="client")
    try:
        wait_members(pool, 2)
        pool.put("warm", b"w" * 4096)
        for w in workers:
            w.kill()  # both still members (suspect) for their entries' TTL
        time.sleep(SUSPECT_S)  # (an answer heard within it says the pool answers: it may, for all it knows)
        errors = []
        for i in range(4):  # single-key puts: each has one owner, the other member owns none of it
            with pytest.raises(PoolUnavailable) as got:
                pool.put(f"k{i}", b"x" * 4096)
            errors.append(type(got.value).__name__)
        assert "PartialPut" not in errors, f"no worker answers, yet the puts raised {errors}"
    finally:
        pool.close()


# Bug: AsyncPoolClient._run (shielded since 10fc4f0) makes a cancelled call wait for its thread to end
# whatever the call: a cancelled `wait_for_members(pred, 12)` (no buffers at stake) holds its caller for
# the whole 12 s, so `asyncio.wait_for(..., 0.5)` returns after 12 s, not within about 1 s (README: a cancelled
# call raises "once its thread's call has ended (within timeout_s)").
def test_a_cancelled_async_wait_for_members_returns_within_timeout_s(nats: NatsServer,
                                                                    spawn: Callable[..., WorkerProcess]) -> None:
    import asyncio

    from kvpool.core.async_client import AsyncPoolClient

    spawn(nats_url=nats.url)

    async def main() -> float:
        async with AsyncPoolClient(mode="cluster", nats_url=nats.url, timeout_s=1.0) as c:
            assert await c.wait_for_members(lambda m: len(m) == 1, 10)
            t0 = time.monotonic()
            with pytest.raises((asyncio.TimeoutError, TimeoutError)):
                await asyncio.wait_for(c.wait_for_members(lambda m: len(m) == 5, 12), 0.5)
            return time.monotonic() - t0

    took = asyncio.run(main())
    assert took < 5.0, f"wait_for(..., 0.5) of a cancelled wait_for_members took {took:.1f} s (client timeout_s 1.0)"


# Bug: the metrics server (core/metrics_http.py, 089abd5) closes an idle connection by its socket's
# timeout, which wsgiref's handler does not catch: socketserver.handle_error prints "Exception occurred
# during processing of request" and a TimeoutError traceback on the worker's stderr for every stranger
# that connects and sends nothing (the logging's SparseLog / once-a-minute rules bypassed).
def test_an_idle_connection_to_the_metrics_port_writes_no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    from prometheus_client import CollectorRegistry

    from kvpool.core.metrics_http import SCRAPE_TIMEOUT_S, MetricsServer

    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    try:
        idle = socket.create_connection(("127.0.0.1", server.port))
        idle.settimeout(SCRAPE_TIMEOUT_S + 5)
        try:
            assert idle.recv(10) == b""  # closed by the server once SCRAPE_TIMEOUT_S passed
        finally:
            idle.close()
        time.sleep(0.2)
    finally:
        server.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err, f"the metrics server wrote to stderr:\n{err}"


# Bug: since 10fc4f0 a call waiting for a cluster client's connection gives up after timeout_s
# (connection._session's lock wait) while a legit long put of another thread holds it (its every frame
# going out in time); FanOut.each then takes the PoolTimeout for the worker's failure: the worker is marked
# down and its shared connection closed, which fails the other thread's put under way. Before, the
# reader waited its turn and both calls succeeded. (The link is made slow here by delaying each PUT frame.)
def test_a_reader_waiting_behind_a_long_put_does_not_fail_that_put(nats: NatsServer,
                                                                  spawn: Callable[..., WorkerProcess],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.core.transport import TcpTransport

    spawn(nats_url=nats.url, dram_bytes="256MiB")
    pool = PoolClient(mode="cluster", nats_url=nats.url, timeout_s=1.0, node_id="elsewhere")  # TCP
    try:
        wait_members(pool, 1)
        pool.put("small", b"s" * 4096)
        send = TcpTransport._send_put

        def slow_link(sock, keys, views, versions):  # type: ignore[no-untyped-def]
            time.sleep(0.3)  # each frame well within timeout_s: the worker answers every one in time
            send(sock, keys, views, versions)

        monkeypatch.setattr(TcpTransport, "_send_put", staticmethod(slow_link))
        keys = [f"big{i}" for i in range(8)]
        bufs = [bytes([i]) * (4 << 20) for i in range(8)]  # 8 frames: ~2.4 s in all
        t, put_error = _putting(pool, keys, bufs)
        time.sleep(0.2)
        try:
            pool.get("small")  # waits for the connection: may fail (bounded by timeout_s), that is not the bug
        except PoolUnavailable:
            pass
        t.join(30)
        assert not put_error, f"the long put failed because another thread's read waited: {put_error[0]!r}"
    finally:
        pool.close()


# Bug: an embedded pool's arena is now anonymous memory (10fc4f0, tiers/dram.py DramArena.__init__), and
# the mmap that cannot be had (a dram_bytes beyond what the machine can commit) raises a raw OSError
# (ENOMEM) out of PoolClient(): the /dev/shm path's OSError is a CapacityError ("cannot create a DRAM
# arena of N bytes"), and the package's errors are KVPoolError subclasses.
def test_an_embedded_arena_too_large_for_the_machine_is_a_capacity_error() -> None:
    from kvpool.core.errors import CapacityError, KVPoolError

    try:
        pool = PoolClient(dram_bytes=1 << 46, prefault=False)  # 64 TiB
    except KVPoolError as e:
        assert isinstance(e, CapacityError), repr(e)
    except Exception as e:  # the bug
        pytest.fail(f"an untyped error from PoolClient(dram_bytes=64 TiB): {e!r}")
    else:
        pool.close()  # (a machine that commits 64 TiB of anonymous memory: nothing to check)


class _Deadline(Exception):
    """What a caller's own deadline (a SIGALRM handler) raises."""


def _alarm(signum: int, frame: object) -> None:
    raise _Deadline("the caller's deadline")


# Bug: an interrupted cluster call (FanOut.each: `_abandon(..., blame=False)`, 10fc4f0) aborts the shared
# connection of each worker its threads were still waiting for: another thread's put in progress on that
# connection fails (and its failure marks the worker down: FanOut.failed), though only the interrupted
# caller gave up and every worker answers in time. (The link is made slow by delaying each PUT frame.)
def test_an_interrupted_read_does_not_fail_another_threads_put(tmp_path, nats: NatsServer,
                                                              spawn: Callable[..., WorkerProcess],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.core.transport import TcpTransport

    for i in range(2):
        spawn(nats_url=nats.url, node_id=f"n{i}", dram_bytes="256MiB")
    pool = PoolClient(mode="cluster", nats_url=nats.url, timeout_s=3.0, node_id="elsewhere")  # TCP
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        wait_members(pool, 2)
        small = [f"s{i}" for i in range(16)]
        pool.batch_put(small, [b"s" * 1024] * 16)  # on both workers
        send = TcpTransport._send_put

        def slow_link(sock, keys, views, versions):  # type: ignore[no-untyped-def]
            time.sleep(0.25)  # a frame well within timeout_s; the put ~1 s in all, each worker's part
            send(sock, keys, views, versions)

        monkeypatch.setattr(TcpTransport, "_send_put", staticmethod(slow_link))
        keys = [f"big{i}" for i in range(16)]
        bufs = [bytes([i]) * (1 << 20) for i in range(16)]
        t, put_error = _putting(pool, keys, bufs)
        time.sleep(0.2)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            pool.batch_get_into(small, [bytearray(1024) for _ in small])  # waits behind the put, interrupted
        except _Deadline:
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        t.join(30)
        assert not put_error, f"another thread's interrupted read failed this put: {put_error[0]!r}"
    finally:
        signal.signal(signal.SIGALRM, old)
        pool.close()


def _putting(pool: PoolClient, keys: list[str], bufs: list[bytes]) -> tuple[threading.Thread, list[BaseException]]:
    """`pool.batch_put(keys, bufs)` under way in a thread; what it raised lands in the list."""
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            pool.batch_put(keys, bufs)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    return t, errors
