"""A worker's limits against an authenticated peer's hostile or buggy requests: same-node requests over its Unix
socket (ALLOC/COMMIT/ABORT/LEASE/RELEASE) and TCP requests (PUT/GET/REMOVE/...), malformed, hostile or
buggy. The standard: bad input gets a typed error or closes that connection with a log line; it never
crashes or hangs the worker, leaks what it holds (slots, leases, memory per request), serves another
client a wrong block, or breaks the worker's other connections.

Each test here was a bug an adversarial check found (its docstring says which)."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.blocks import checksum
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport, TcpTransport

SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}
TOKEN = "adversarial-pool-token-" + "x" * 40


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    """A worker with a token (TCP peers authenticate) on a 32 MiB arena of 1 MiB slabs."""
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), token=TOKEN),  # type: ignore[arg-type]
               CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    yield w
    w.stop()


def _roundtrip(sock: socket.socket, op: int, meta: bytes = b"", data: list[memoryview] | None = None) -> P.Frame:
    P.send_frame(sock, op, meta, data=data)
    return P.recv_reply(sock, op)


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) >> 10


def test_tiny_allocs_cannot_reserve_more_than_a_connections_share_of_the_arena(worker: Worker) -> None:
    """Regression: a same-node connection may hold at most `max_reserve` (1/8 of the arena) allocated and not
    committed, but `_alloc` charges that budget with the sizes the client *asks* for, not the slots it
    gets. A 0-byte block costs nothing of the budget yet takes a 256-byte slot (1 byte: 1 of the budget,
    256 of the arena), so one connection that ALLOCs tiny blocks and never commits them reserves the
    whole arena (evicting what it must): every other client's put then fails with CapacityError for as
    long as that connection lives."""
    t = ShmTransport(worker.unix_path)
    honest = TcpTransport(worker.address, token=TOKEN)
    try:
        with t._session() as sock:
            keys = [b"tiny%06d" % i for i in range(P.MAX_BATCH)]
            for _ in range(2):  # 2 x 65536 slots of 256 bytes: the whole 32 MiB arena, for 0 bytes of budget
                reply = _roundtrip(sock, P.Op.ALLOC, P.pack_batch(keys, np.zeros(len(keys), "<i8")))
                assert len(reply.meta) == 8 * len(keys)
            held = worker.cache.stats().dram_bytes  # all of it this connection's uncommitted slots
            ok = True
            try:
                honest.batch_put([b"honest"], [b"h" * 100_000])  # far less than the 7/8 left to others
            except Exception as e:  # what the honest client gets is the finding
                ok = repr(e)
        assert held <= 2 * worker.max_reserve, (
            f"one connection holds {held} bytes of slots reserved; max_reserve is {worker.max_reserve}")
        assert ok is True, f"an honest put failed while another connection held tiny reservations: {ok}"
    finally:
        t.close()
        honest.close()
    time.sleep(0.2)
    assert worker.cache.stats().dram_bytes <= 100_000 + (1 << 20)  # given back when the connection closed


def test_a_put_stamped_far_in_the_future_does_not_shadow_every_later_put(worker: Worker) -> None:
    """Regression: the worker takes a block's version from the wire as it is. A PUT (or COMMIT) stamped 2^64-1 (a
    buggy writer, a garbage column) is stored with it; `HybridClock.observe` caps the worker's *clock* at
    CLOCK_SKEW_MS ahead "so a forged or broken version must not beat every other writer's later ones", but
    the block keeps its version, so every later put of the key, however honest, is ITEM_SUPERSEDED:
    `batch_put` re-stamps above what the worker reports (capped too), is superseded again and returns as
    if stored, and a get serves the old block. The same holds for REMOVE and SUPERSEDE with such a version
    (a tombstone that silently swallows every put of the key for `keep_s`, 600 s, and goes into the
    change log that peers catch up from)."""
    t = TcpTransport(worker.address, token=TOKEN)
    honest = TcpTransport(worker.address, token=TOKEN)
    try:
        evil = b"EVIL" * 256
        with t._session() as sock:
            meta = P.pack_batch([b"key"], np.array([len(evil)], "<i8"), np.array([checksum(evil)], "<u8"),
                                np.array([2**64 - 1], "<u8"))
            reply = _roundtrip(sock, P.Op.PUT, meta, [memoryview(evil)])
        stored_evil = np.frombuffer(reply.meta, "<i1").tolist() == [P.ITEM_OK]
        good = b"GOOD" * 256
        honest.batch_put([b"key"], [good])  # returns as a put that took effect
        out = bytearray(len(good))
        got = honest.batch_get_into([b"key"], [out])
        assert not (stored_evil and got == [len(good)] and bytes(out) == evil), (
            "a put acknowledged after the far-future one is not what a get serves: the old block is")
        assert got == [len(good)] and bytes(out) == good
    finally:
        t.close()
        honest.close()


def test_unreleased_leases_do_not_grow_the_worker_without_bound(worker: Worker) -> None:
    """Regression: each LEASE adds an entry per hit to the connection's `leases` (and a lease on the block) until
    a RELEASE or the connection's end, with no bound: unlike reservations (`max_reserve`), a same-node
    client that leases and never releases (a bug, a reader that leaks its leases) grows the worker by
    ~90 MB per million leases, one 65,536-key request at a time (~0.03 s each), until it runs out of memory.
    Expected: a per-connection cap (refused with a typed error, or the connection closed and logged)."""
    data = b"L" * 1000
    honest = TcpTransport(worker.address, token=TOKEN)
    honest.batch_put([b"leased"], [data])
    t = ShmTransport(worker.unix_path)
    try:
        before = _rss_mib()
        with t._session() as sock:
            meta = P.pack_batch([b"leased"] * P.MAX_BATCH)
            for _ in range(24):  # 1.5 M leases of one block, none released
                try:
                    _roundtrip(sock, P.Op.LEASE, meta)
                except (P.ProtocolError, ConnectionError, OSError):
                    break  # refused: the bound this test asks for
        grown = _rss_mib() - before
        held = worker.cache.stats().dram_leases
        assert grown < 48, f"the worker grew {grown} MiB holding {held} leases for one connection"
    finally:
        t.close()
        honest.close()
    time.sleep(0.3)
    assert worker.cache.stats().dram_leases == 0


def test_a_get_reply_never_exceeds_the_protocols_data_limit(worker: Worker) -> None:
    """Regression: `_get` answers every hit of a batch in one frame whatever their total, and the client frames a
    GET by key count only (`P.frames(len(keys))`, no sizes: it cannot know them). A batch whose hits add
    up to more than MAX_DATA (8 GiB: here one 1 MiB block named 8193 times; on a real arena, a few hundred
    distinct 16 MiB blocks) gets a reply frame that no peer accepts (`recv_frame`: "frame ... exceeds"),
    so the client's call fails as PoolUnavailable and its connection drops, rather than a typed error or
    the batch answered in parts."""
    block = b"B" * (1 << 20)
    honest = TcpTransport(worker.address, token=TOKEN)
    honest.batch_put([b"big"], [block])
    n = P.MAX_DATA // len(block) + 1
    with socket.create_connection(("127.0.0.1", worker.port), timeout=10) as raw:
        t = TcpTransport(worker.address, token=TOKEN)
        t._handshake(raw)  # authenticate this raw socket as any client does
        t.close()
        P.send_frame(raw, P.Op.GET, P.pack_batch([b"big"] * n))
        head = bytearray(P.HEADER.size)
        P.recv_exactly(raw, memoryview(head))
        _, _, op, status, _, _, data_len, _, _ = P.HEADER.unpack(head)
    assert op == P.Op.GET
    assert status != P.Status.OK or data_len <= P.MAX_DATA, (
        f"the worker answered a GET with a frame of {data_len} data bytes; the protocol's limit is {P.MAX_DATA}")
    honest.close()
    time.sleep(0.3)
    assert worker.cache.stats().dram_leases == 0  # what the GET leased went back with its connection


def test_frames_count_each_reserved_block_as_the_worker_charges_it() -> None:
    """A client splits a same-node put as the worker charges its reservations (`RESERVE_FLOOR` a block beyond
    its size), so a frame is never refused for want of budget the client thought it had."""
    tiny = [0] * 100
    assert P.frames(len(tiny), tiny, 100 * P.RESERVE_FLOOR, P.RESERVE_FLOOR) == [slice(0, 100)]
    assert P.frames(len(tiny), tiny, 50 * P.RESERVE_FLOOR, P.RESERVE_FLOOR) == [slice(0, 50), slice(50, 100)]
    assert P.frames(2, [1000, 1000], 2000 + 2 * P.RESERVE_FLOOR, P.RESERVE_FLOOR) == [slice(0, 2)]
    assert P.frames(2, [1000, 1000], 2000, P.RESERVE_FLOOR) == [slice(0, 1), slice(1, 2)]
