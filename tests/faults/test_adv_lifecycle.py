"""Adversarial lifecycle checks: what a user makes and drops (closed, garbage-collected, or left in a
`with` by an exception) gives back its threads, file descriptors, memory, pins and locks."""
from __future__ import annotations

import gc
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.core.cache import TieredCache
from kvpool.core.client import PoolClient
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.streams import Producer, StreamConfig, create_stream

from faulthelp import poll


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> list[str]:
    """This process's threads by name, less a cluster client's call pool (it grows on demand, to 32)."""
    return sorted(t.name for t in threading.enumerate() if not t.name.startswith("kvpool-fanout"))


def _extra(baseline_threads: list[str]) -> list[str]:
    """Threads now that the baseline did not have (a thread that ended meanwhile is no leak)."""
    return sorted((Counter(_threads()) - Counter(baseline_threads)).elements())


def _settled(baseline_threads: list[str], baseline_fds: int, timeout: float = 5.0) -> bool:
    """Whether this process's threads and fds come back to the baseline (after a collection)."""
    def back() -> bool:
        gc.collect()
        return not _extra(baseline_threads) and _fds() <= baseline_fds
    return poll(back, timeout, every=0.2)


# Bug: a Producer dropped without close() (garbage-collected) keeps its reconciler thread (PinKeeper, which the
# thread itself keeps alive) and its NATS connection for the life of the process, and that thread renews its
# payloads' pins for ever: the README promises "If the producer ... dies ... the workers drop them pin_ttl_s
# later, so a pin never leaks for longer than that" (a closed producer's pins do expire: checked first).
def test_a_dropped_producer_lets_its_pins_expire_and_frees_its_thread_and_connection(
        nats: NatsServer, spawn: Callable[..., WorkerProcess]) -> None:
    spawn(nats_url=nats.url)
    create_stream(nats.url, "drops", StreamConfig())
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        pool.put("warm", bytes(300_000))  # (the client's own threads and connections, made once)
        pool.stats()
        gc.collect()
        threads, fds = _threads(), _fds()

        closed = Producer("drops", nats.url, pool, pin_ttl_s=1.0)
        closed.publish(bytes(300_000))  # by reference: pinned in the pool, no consumer ever acks it
        assert pool.stats().total.pins == 1
        closed.close()
        assert poll(lambda: pool.stats().total.pins == 0, 5), "a closed producer's pin did not expire"
        assert _settled(threads, fds), \
            f"a closed producer left threads {_extra(threads)} / {_fds() - fds} fds"

        dropped = Producer("drops", nats.url, pool, pin_ttl_s=1.0)
        dropped.publish(bytes(300_000))
        assert pool.stats().total.pins == 1
        del dropped
        gc.collect()
        assert poll(lambda: pool.stats().total.pins == 0, 6), \
            "a dropped producer's payload is still pinned 6 s past its pin_ttl_s of 1 s"
        assert _settled(threads, fds), \
            f"a dropped producer left threads {_extra(threads)} / {_fds() - fds} fds"


# Bug: a TieredCache dropped without close() is never collected (its demoter thread holds it), so it keeps
# the thread, its whole DRAM arena (anonymous memory) and its SSD folder's lock for the life of the process:
# a new TieredCache on the same ssd_path in the same process is refused with StorageError "in use by another
# process (pid <this very pid>)". SsdStore's own finalizer ("a store dropped unclosed lets go too") never runs.
def test_a_dropped_tiered_cache_releases_its_ssd_folder_thread_and_memory(tmp_path: Path) -> None:
    gc.collect()
    threads = _threads()
    cache = TieredCache(dram_bytes=32 << 20, dram_slab_size="1MiB", prefault=False, ssd_path=str(tmp_path / "ssd"))
    cache.put(b"k", b"x" * 4096)
    del cache
    gc.collect()
    again = TieredCache(dram_bytes=32 << 20, dram_slab_size="1MiB", prefault=False,
                        ssd_path=str(tmp_path / "ssd"))  # StorageError today: "in use by another process"
    again.close()
    assert _settled(threads, 10**6), f"threads left: {_extra(threads)}"


# Bug: stream and event readers dropped without close() (garbage-collected) keep their event-loop thread
# and NATS connection for the life of the process (LoopThread's thread holds the loop, the loop the
# connection), which then reconnects for ever once NATS goes; a PoolClient dropped the same way releases
# everything (its weakref.finalize: "Engines drop their store without close() and rely on the destructor").
@pytest.mark.parametrize("kind", ["consumer", "handoff_receiver", "event_feed"])
def test_a_dropped_stream_reader_frees_its_thread_and_connection(nats: NatsServer, kind: str) -> None:
    from kvpool.core.events import EventFeed
    from kvpool.core.memory_backend import MemoryBackend
    from kvpool.streams import Consumer, HandoffReceiver

    create_stream(nats.url, "readers", StreamConfig())
    pool = PoolClient(backend=MemoryBackend())
    make: dict[str, Callable[[], object]] = {
        "consumer": lambda: Consumer("readers", nats.url, timeout_s=5),
        "handoff_receiver": lambda: HandoffReceiver("readers", nats.url, pool, timeout_s=5),
        "event_feed": lambda: EventFeed(nats.url, timeout_s=5),
    }
    make[kind]().close()  # (imports, the events stream made once)  # type: ignore[attr-defined]
    gc.collect()
    time.sleep(0.3)
    threads, fds = _threads(), _fds()
    for _ in range(3):
        reader = make[kind]()
        del reader
    assert _settled(threads, fds), \
        f"3 dropped {kind}s left threads {_extra(threads)} and {_fds() - fds} fds"


# Bug: a consume() loop outlives its AsyncConsumer: once the consumer is closed (here by an exception leaving
# its `async with`, the handle never stopped), the loop's task runs for ever, taking the closed connection
# for NATS being away ("receive ... ConnectionClosedError(); retrying"): a warning every 0.5 s for the life
# of the event loop, and a task nobody can stop but through a handle the exception took away.
def test_closing_an_async_consumer_ends_its_consume_loop(nats: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    from kvpool.streams import AsyncConsumer, Consuming

    create_stream(nats.url, "consumed", StreamConfig())
    handles: list[Consuming] = []

    async def run() -> tuple[bool, int]:
        with pytest.raises(RuntimeError):
            async with AsyncConsumer("consumed", nats.url, timeout_s=5) as consumer:
                handles.append(await consumer.consume(lambda msg: None))
                await asyncio.sleep(0.3)
                raise RuntimeError("the application fails inside the with")
        caplog.clear()
        await asyncio.sleep(3.0)
        running = handles[0].running
        retries = sum("retrying" in r.getMessage() for r in caplog.records)
        if running:
            await handles[0].stop()
        return running, retries

    running, retries = asyncio.run(run())
    assert not running and retries == 0, \
        f"3 s after its consumer closed, the consume loop still runs ({retries} 'retrying' warnings meanwhile)"


# Bug: Ctrl-C while a cluster client (or an EventFeed) waits for NATS at construction (up to 10 s when NATS is
# away) leaves its event-loop thread and the loop's fds for the life of the process: Membership.__init__
# (core/cluster.py) and EventFeed.__init__ (core/events.py) clean up on `except Exception` only, so a
# KeyboardInterrupt skips `_disconnect()` / `_io.stop()` (streams' Link uses `except BaseException` and
# leaves nothing: the README's "a call that leaves ... early for any other reason (Ctrl-C ...)" drops what it had).
@pytest.mark.parametrize("kind", ["cluster_client", "event_feed"])
def test_ctrl_c_while_waiting_for_nats_at_construction_leaves_no_thread(kind: str) -> None:
    import signal

    from kvpool.core.events import EventFeed
    from kvpool.core.nats_server import free_port

    url = f"nats://127.0.0.1:{free_port()}"  # nobody listens: construction waits for its timeout
    make: dict[str, Callable[[], object]] = {
        "cluster_client": lambda: PoolClient(mode="cluster", nats_url=url, timeout_s=2),
        "event_feed": lambda: EventFeed(url, timeout_s=2),
    }
    gc.collect()
    threads, fds = _threads(), _fds()
    # (a process started in the background by a non-interactive shell, as CI's, ignores SIGINT: Ctrl-C's
    # own handler, explicitly)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            make[kind]()
        timer.join()
    finally:
        signal.signal(signal.SIGINT, before)
    assert _settled(threads, fds, timeout=12), \
        f"Ctrl-C during a {kind}'s start left threads {_extra(threads)} and {_fds() - fds} fds"
