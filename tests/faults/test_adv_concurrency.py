"""Adversarial checks of concurrency, cancellation and interruption in the clients: a client shared by
threads, calls cancelled (asyncio) or interrupted (a signal handler's exception) mid-flight, close while
calls run and calls after it, and a cluster client inherited by a forked child."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from kvpool.core import protocol as P
from kvpool.core.async_client import AsyncPoolClient
from kvpool.core.client import PoolClient
from kvpool.core.errors import KVPoolError
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess

from faulthelp import poll, wait_members
from sigstop import freeze


class Deadline(Exception):
    """What a caller's own deadline (a SIGALRM handler) raises."""


def _alarm(signum: int, frame: object) -> None:
    raise Deadline("the caller's deadline")


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _arena_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/kvpool-" in line for line in f)


# Bug: in local mode a call after close() silently reconnects (socket + arena mapping), and a second
# close() no longer releases anything (the finalizer ran once): what it holds stays until garbage collection.
def test_local_client_used_after_close_releases_what_it_holds_on_close(spawn: Callable[..., WorkerProcess]) -> None:
    worker = spawn()
    for address in (worker.unix_path, worker.address):
        fds0, maps0 = _fds(), _arena_maps()
        pool = PoolClient(mode="local", worker=address)
        try:
            pool.put("a", b"x" * 100)
            pool.close()
            try:
                pool.get("a")  # refused (typed), or served; either way close() must release it again
            except KVPoolError:
                pass
            pool.close()
            assert _fds() - fds0 == set(), f"{address}: sockets left open after close()"
            assert _arena_maps() == maps0, f"{address}: the worker's arena still mapped after close()"
        finally:
            pool.backend.close()  # (the test's own cleanup, so that nothing leaks into the next test)


# Bug: ShmTransport._count_leases lets a lease released on a connection closed since overwrite the count of
# the current connection's leases: batch_lease then asks for more than MAX_LEASES in place (the README/
# docstring promise copies past it), the worker refuses, and the connection drop ends every thread's leases.
def test_a_lease_outliving_its_connection_does_not_corrupt_the_count_of_the_next_ones(
        spawn: Callable[..., WorkerProcess]) -> None:
    worker = spawn()
    pool = PoolClient(mode="local", worker=worker.unix_path, timeout_s=1.0)
    pool.put("k", b"v" * 64)
    errors: dict[str, BaseException] = {}
    a_in, a_go, b_in, b_go = (threading.Event() for _ in range(4))

    def old_lease() -> None:  # a lease taken on the first connection, held past its close
        try:
            with pool.lease("k"):
                a_in.set()
                a_go.wait(30)
        except KVPoolError as e:  # documented: its connection closed meanwhile
            errors["old"] = e

    def other_thread() -> None:  # leases on the next connection, held while a third thread leases
        try:
            with pool.batch_lease(["k"] * 1000) as views:
                b_in.set()
                b_go.wait(60)
                assert all(bytes(v) == b"v" * 64 for v in views)
        except BaseException as e:
            errors["other"] = e

    a = threading.Thread(target=old_lease)
    a.start()
    assert a_in.wait(10)
    freeze(worker.proc.pid)
    try:
        try:
            pool.exists("k")  # times out: the connection closes (the old lease ends with it)
        except KVPoolError:
            pass
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    b = threading.Thread(target=other_thread)
    b.start()
    try:
        assert b_in.wait(10)
        a_go.set()
        a.join(10)
        try:
            with pool.batch_lease(["k"] * P.MAX_LEASES) as views:  # past the room left: copies
                assert len(views) == P.MAX_LEASES and all(v is not None for v in views[:3] + views[-3:])
        except KVPoolError as e:
            pytest.fail(f"a batch_lease of MAX_LEASES keys while another thread holds 1000 failed: {e!r}")
    finally:
        a_go.set()
        b_go.set()
        b.join(30)
        pool.close()
    assert "other" not in errors, f"another thread's leases were ended: {errors['other']!r}"


def _two_worker_cluster(tmp_path, spawn: Callable[..., WorkerProcess]) -> tuple[NatsServer, list[WorkerProcess]]:
    ns = NatsServer(tmp_path / "nats", port=0).start()
    return ns, [spawn(nats_url=ns.url) for _ in range(2)]


# Bug: a cluster call interrupted while it waits on its fan-out (a signal handler's exception, Ctrl-C)
# leaves the fan-out threads running: they write into the caller's buffers after the call has raised
# (FanOut.each skips `_abandon` for a BaseException out of `wait`).
def test_an_interrupted_cluster_read_writes_nothing_into_the_buffers_afterwards(tmp_path, spawn, caplog) -> None:
    ns, workers = _two_worker_cluster(tmp_path, spawn)
    before = signal.signal(signal.SIGALRM, _alarm)
    try:
        for node in (None, "elsewhere"):  # shared memory, and TCP
            pool = PoolClient(mode="cluster", nats_url=ns.url, timeout_s=5, node_id=node)
            try:
                wait_members(pool, 2)
                keys = [f"k{i}" for i in range(16)]
                pool.batch_put(keys, [k.encode() * 10 for k in keys])
                bufs = [bytearray(100) for _ in keys]
                freeze(workers[1].proc.pid)
                try:
                    signal.setitimer(signal.ITIMER_REAL, 0.3)
                    try:
                        pool.batch_get_into(keys, bufs)
                    except Deadline:
                        pass
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                    for b in bufs:  # the caller has its buffers back, and reuses them
                        b[:] = bytes(100)
                finally:
                    os.kill(workers[1].proc.pid, signal.SIGCONT)
                time.sleep(1.5)
                written = [keys[i] for i, b in enumerate(bufs) if any(b)]
                assert not written, f"node {node}: written after the call raised: {written}"
                # the workers were not at fault: none is taken as down or slow, and reads ask them again, on
                # fresh connections (the frozen worker itself serves misses until its stall fence lifts:
                # a heartbeat after it wakes, later under load)
                blamed = [r.getMessage() for r in caplog.records if "treating it as" in r.getMessage()]
                assert not blamed, f"node {node}: {blamed}"
                whole = [len(k) * 10 for k in keys]
                assert poll(lambda p=pool, ks=keys, bs=bufs, w=whole: p.batch_get_into(ks, bs) == w, 10)
                assert all(b.startswith(k.encode() * 10) for b, k in zip(bufs, keys))
            finally:
                pool.close()
    finally:
        signal.signal(signal.SIGALRM, before)
        for w in workers:
            w.stop()
        ns.stop()


# Bug: AsyncPoolClient runs each call in a thread that a cancellation (asyncio.wait_for, task.cancel())
# does not stop: get_into keeps writing into the caller's buffer after the caller got control back.
def test_a_cancelled_async_get_into_writes_nothing_into_the_buffer_afterwards(spawn) -> None:
    worker = spawn()

    async def main(address: str) -> bytes:
        client = AsyncPoolClient(PoolClient(mode="local", worker=address, timeout_s=5))
        try:
            await client.put("alpha", b"A" * 100)
            buf = bytearray(100)
            freeze(worker.proc.pid)
            try:
                try:
                    await asyncio.wait_for(client.get_into("alpha", buf), 0.3)
                except asyncio.TimeoutError:
                    pass
                buf[:] = bytes(100)  # the caller has its buffer back, and reuses it
            finally:
                os.kill(worker.proc.pid, signal.SIGCONT)
            await asyncio.sleep(1.0)
            assert await client.get("alpha") == b"A" * 100  # the client stays usable
            return bytes(buf)
        finally:
            await client.close()

    for address in (worker.unix_path, worker.address):
        assert asyncio.run(main(address)) == bytes(100), f"{address}: written after the call was cancelled"


# Bug: a forked child's cluster client has no fan-out threads (nor NATS loop): a read spread over two
# live workers holding every key waits out timeout_s and returns all misses, without an error.
def test_a_forked_child_reads_through_its_inherited_cluster_client(tmp_path, spawn) -> None:
    ns, workers = _two_worker_cluster(tmp_path, spawn)
    try:
        pool = PoolClient(mode="cluster", nats_url=ns.url, timeout_s=2, node_id="elsewhere")
        wait_members(pool, 2)
        keys = [f"k{i}" for i in range(16)]
        pool.batch_put(keys, [k.encode() * 10 for k in keys])
        assert min(pool.batch_get_into(keys, [bytearray(100) for _ in keys])) > 0  # both workers asked
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                try:
                    sizes = pool.batch_get_into(keys, [bytearray(100) for _ in keys])
                    out = "ok" if min(sizes) > 0 else f"misses {sizes}"
                except KVPoolError as e:  # a typed refusal would do
                    out = f"ok (refused: {type(e).__name__})"
                os.write(w, out.encode())
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as f:
            got = f.read().decode()
        assert got.startswith("ok"), f"the child's read of keys both workers hold: {got}"
        assert min(pool.batch_get_into(keys, [bytearray(100) for _ in keys])) > 0
        pool.close()
    finally:
        for w_ in workers:
            w_.stop()
        ns.stop()


def _calls_on_a_hung_worker(pool: PoolClient, pid: int, n: int = 4) -> list[tuple[float, str]]:
    """`n` threads sharing `pool` each make one call while worker `pid` is paused: (seconds, outcome)."""
    out: list[tuple[float, str]] = []

    def call(i: int) -> None:
        t0 = time.monotonic()
        try:
            what = repr(pool.get("a") if i % 2 else pool.put("b", b"b" * 100))[:20]
        except KVPoolError as e:
            what = type(e).__name__
        except Exception as e:  # reported by the test
            what = f"untyped {e!r}"
        out.append((time.monotonic() - t0, what))

    freeze(pid)
    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(n * 3 + 5)
    finally:
        os.kill(pid, signal.SIGCONT)
    return sorted(out)


# Bug: one connection per worker, taken with a blocking lock: calls of threads sharing a client queue behind
# one another on a hung worker, and the k-th returns after k x timeout_s (README: "each call bounded by
# timeout_s"; its PoolTimeout says "did not answer within 1.0 s").
@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_threads_sharing_a_local_client_each_return_within_timeout_s_of_a_hung_worker(spawn, path: str) -> None:
    worker = spawn()
    pool = PoolClient(mode="local", worker=worker.unix_path if path == "shm" else worker.address, timeout_s=1.0)
    try:
        pool.put("a", b"a" * 100)
        outcomes = _calls_on_a_hung_worker(pool, worker.proc.pid)
        assert not [o for o in outcomes if o[1].startswith("untyped")], outcomes
        assert max(t for t, _ in outcomes) < 2.0, f"calls with timeout_s 1.0 took: {outcomes}"
        assert pool.get("a") == b"a" * 100
    finally:
        pool.close()


# Bug: the same in cluster mode, where the README promises a call "returns within timeout_s however many hang".
@pytest.mark.parametrize("node", [None, "elsewhere"], ids=["shm", "tcp"])
def test_threads_sharing_a_cluster_client_each_return_within_timeout_s_of_a_hung_worker(tmp_path, spawn,
                                                                                       node: str | None) -> None:
    ns = NatsServer(tmp_path / "nats", port=0).start()
    try:
        worker = spawn(nats_url=ns.url)
        pool = PoolClient(mode="cluster", nats_url=ns.url, timeout_s=1.0, node_id=node)
        try:
            wait_members(pool, 1)
            pool.put("a", b"a" * 100)
            outcomes = _calls_on_a_hung_worker(pool, worker.proc.pid)
            assert not [o for o in outcomes if o[1].startswith("untyped")], outcomes
            assert max(t for t, _ in outcomes) < 2.0, f"calls with timeout_s 1.0 took: {outcomes}"
        finally:
            pool.close()
    finally:
        ns.stop()


# Bug: an embedded pool's arena is shared memory (MAP_SHARED) while its index is the process's own: after
# os.fork() the child's puts land in slots the parent's blocks still occupy, and the parent serves the
# child's bytes under its own key (no error, no checksum failure).
def test_a_forked_childs_puts_never_change_what_the_parents_embedded_pool_serves() -> None:
    pool = PoolClient(dram_bytes=16 << 20)
    try:
        pool.put("parent-a", b"P" * 65536)
        pid = os.fork()
        if pid == 0:
            try:
                for i in range(400):  # 25 MiB through the child's 16 MiB pool: it evicts, and reuses slots
                    try:
                        pool.put(f"child-{i}", b"C" * 65536)
                    except KVPoolError:
                        break  # (a typed refusal in the child would do)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        got = pool.get("parent-a")
        assert got is None or got == b"P" * 65536, f"the parent's block now reads {got[:8]!r}..."
    finally:
        pool.close()
