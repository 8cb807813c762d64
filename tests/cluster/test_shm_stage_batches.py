"""Staged puts whose commits go together (`kvpool.core.shm_stage`, `HOLD_PUTS`/`HOLD_S`), under
races and failures: a batch stays within what one request and the socket's buffers take; `settle`
raced by the stager's own flusher still waits for and raises a refused commit; one lost connection
fails one call, not two; a stager dropped unclosed is collected with its slots; an empty put is a
no-op; `close` commits what was held; a connection the worker dropped is never written through
(another writer's blocks stay whole); and shapes, pins, refusals and a full worker mid-batch leave
every block stored or refused and the cache consistent. (Found by an audit of the change, session AH.)"""
from __future__ import annotations

import collections
import gc
import socket
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from stagehelp import (
    all_given_back,
    lying_about,
    make_blocks,
    protocol_errors,
    reserved_bytes,
    stager_for,
    stored,
    wait_for,
)

from kvpool.core import protocol as P
from kvpool.core import shm_stage
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import CapacityError, CorruptBlock, PoolUnavailable
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport

MiB = 1 << 20


def make_worker(tmp_path: Path, dram_bytes: int) -> Worker:
    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "big.sock")),
                  CacheConfig(dram_bytes=dram_bytes, dram_slab_size=4 << 20, prefault=False)).start()  # type: ignore[arg-type]
















# ---------------------------------------------------------------------------------------------------
# 1. A batch of held puts (and the ALLOC for the next `batch` puts) can exceed P.MAX_BATCH items:
#    fits() checks one put against one frame only, so a shape it accepts makes requests the worker
#    refuses as a protocol error (connection dropped, commits lost).
# ---------------------------------------------------------------------------------------------------

def test_a_fitted_shape_of_many_small_blocks_batches_past_MAX_BATCH(tmp_path: Path) -> None:
    w = make_worker(tmp_path, dram_bytes=1 << 30)  # a 1 GiB arena: 128 MiB reserve per connection
    stager, reader = stager_for(w), ShmTransport(w.unix_path)
    try:
        n, size = 8200, 512  # a layer of 8200 blocks of 512 B (4 MiB): one frame, well within the budget
        assert stager.fits([size] * n)
        assert stager._batch == 1
        layers = [[f"L{i}/{j}".encode() for j in range(n)] for i in range(3)]
        blocks = np.arange(size, dtype=np.uint8)
        for keys in layers:
            stager.put(keys, [memoryview(blocks)] * n)
        stager.settle()
        assert protocol_errors(w) == 0
        for keys in layers:
            assert stored(reader, keys[:4], [blocks] * 4)
    finally:
        stager.close()
        reader.close()
        w.stop()


# ---------------------------------------------------------------------------------------------------
# 2. settle() reads `self._owed` and `self._held.puts` without the lock: the flusher moving the held
#    commits into `_owed` between the two reads makes settle return without waiting for their answers
#    (a refused commit is not raised; the commit may not be done when settle returns).
# ---------------------------------------------------------------------------------------------------

class _PreemptedOnce(collections.deque):
    """`_owed`, whose truth test, once armed, takes a while (the producer's thread descheduled there)."""
    armed = 0.0

    def __bool__(self) -> bool:
        value = len(self) > 0
        if self.armed:
            pause, self.armed = self.armed, 0.0
            time.sleep(pause)  # the flusher's deadline passes meanwhile
        return value


def test_settle_racing_the_flusher_returns_without_the_refused_commit(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.05)
    good, bad = make_blocks(1, 64 << 10), make_blocks(2, 64 << 10)
    monkeypatch.setattr(shm_stage, "copy_into", lying_about(bad[0]))
    monkeypatch.setitem(worker._handlers, P.Op.COMMIT_UNCHECKED, worker._commit)  # refuses the bad one
    stager = stager_for(worker)
    stager._owed = _PreemptedOnce()
    try:
        assert stager.fits([64 << 10])
        stager.put([b"good"], [memoryview(good[0])])  # after a pause: sent at once (with the next ALLOC)
        stager.put([b"bad"], [memoryview(bad[0])])  # held, the flusher armed for it
        assert stager._held.puts == 1 and not stager._owed
        stager._owed.armed = 0.2
        with pytest.raises(CorruptBlock):
            stager.settle()  # "wait until the worker answered every put; raise the first failure"
    finally:
        stager.close()


# ---------------------------------------------------------------------------------------------------
# 3. A put that fails on a broken/slow connection releases Stager._lock before `_forget` takes it
#    again; a flusher waiting for the lock then finds the held commits of the dead connection,
#    fails on the generation check and stores that PoolUnavailable in `_failed`: the producer's NEXT
#    put, on a fresh healthy connection, raises it again (and closes that connection).
# ---------------------------------------------------------------------------------------------------

def test_one_lost_connection_fails_two_puts(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.05)
    stager = stager_for(worker)
    real_forget = stager._forget

    def forget_after_a_preemption() -> None:
        time.sleep(0.1)  # the producer's thread descheduled between the session's failure and _forget
        real_forget()
    stager._forget = forget_after_a_preemption  # type: ignore[method-assign]
    try:
        assert stager.fits([64 << 10])
        stager.put([b"a"], [memoryview(make_blocks(1, 64 << 10)[0])])
        stager.put([b"b"], [memoryview(make_blocks(2, 64 << 10)[0])])  # held, the flusher armed for it
        for conn in list(worker._conns):  # the worker drops the connection
            socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
        with pytest.raises(PoolUnavailable):  # a put of another shape reads the worker's answers: the failure
            stager.put([b"c"], [memoryview(make_blocks(3, 32 << 10)[0])])
        later = make_blocks(4, 64 << 10)
        stager.put([b"later"], [memoryview(later[0])])  # a new connection: this put should go
        stager.settle()
    finally:
        stager.close()
    all_given_back(worker)


# ---------------------------------------------------------------------------------------------------
# 4. (pre-existing, not introduced by the change) Spare slots are used without any exchange with the
#    worker: after the WORKER closes the stager's connection (protocol error, io_timeout_s, drain), it
#    frees their reservations and gives them to another writer, and the stager's next put copies into
#    them anyway, overwriting that writer's committed blocks. `ShmTransport.copying` only guards a
#    close on the client's side.
# ---------------------------------------------------------------------------------------------------

def test_a_put_after_the_worker_dropped_the_connection_overwrites_another_writers_block(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.5, raising=False)  # (the put below comes within it)
    stager, other, reader = stager_for(worker), ShmTransport(worker.unix_path), ShmTransport(worker.unix_path)
    try:
        assert stager.fits([64 << 10])
        stager.put([b"a0"], [memoryview(make_blocks(0, 64 << 10)[0])])
        stager.put([b"a1"], [memoryview(make_blocks(1, 64 << 10)[0])])  # spare slots in hand now
        mine = [c for c in worker._conns if c.reserved]
        assert len(mine) == 1
        socket.socket.shutdown(mine[0].sock, socket.SHUT_RDWR)  # the worker drops the stager's connection
        wait_for(lambda: mine[0] not in worker._conns)  # ... and frees its reservations
        theirs = [make_blocks(100 + i, 64 << 10) for i in range(16)]
        other.batch_put([f"theirs{i}".encode() for i in range(16)], [b[0] for b in theirs])
        for i in range(2, 6):
            try:
                stager.put([f"a{i}".encode()], [memoryview(make_blocks(i, 64 << 10)[0])])
            except PoolUnavailable:
                break
        out = [np.zeros(64 << 10, dtype=np.uint8) for _ in theirs]
        got = reader.batch_get_into([f"theirs{i}".encode() for i in range(16)], out)
        damaged = [i for i, (g, o, b) in enumerate(zip(got, out, theirs))
                   if g != b[0].nbytes or not np.array_equal(o, b[0])]
        assert damaged == [], f"another writer's committed blocks overwritten by the stager: {damaged}"
    finally:
        stager.close()
        other.close()
        reader.close()


# ---------------------------------------------------------------------------------------------------
# 5. A Stager dropped without close() is never collected now: its `_Flusher` thread holds the bound
#    method `_flush_late`, so the stager, its connection and the spare slots reserved on it live until
#    the process exits (at bc7b7cc the stager was collected, its socket closed, the slots freed).
# ---------------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_unclosed_stager_is_collected_and_its_slots_go_back(worker: Worker) -> None:  # (its socket unclosed)
    stager = stager_for(worker)
    assert stager.fits([64 << 10])
    for i in range(3):
        stager.put([f"u{i}".encode()], [memoryview(make_blocks(i, 64 << 10)[0])])
    ref = weakref.ref(stager)
    del stager
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not (ref() is None and reserved_bytes(worker) == 0):
        gc.collect()
        time.sleep(0.05)
    assert (ref() is None, reserved_bytes(worker)) == (True, 0), \
        f"alive={ref() is not None}, reserved={reserved_bytes(worker)} bytes, flush threads=" \
        f"{[t.name for t in threading.enumerate() if t.name == 'kvpool-stage-flush']}"


# ---------------------------------------------------------------------------------------------------
# 6. (minor) An empty put: `_answer` now splits an ALLOC's answer by `len(sizes) // len(keys)`:
#    ZeroDivisionError (bc7b7cc: it went through). Only reachable by calling Stager.put directly
#    (Stagers.for_keys asks fits([]), which says no).
# ---------------------------------------------------------------------------------------------------

def test_an_empty_put(worker: Worker) -> None:
    stager = stager_for(worker)
    try:
        stager.put([], [])
        stager.settle()
    finally:
        stager.close()


# ---------------------------------------------------------------------------------------------------
# 7. close() sends the held commits and closes at once without reading the answers owed; the worker,
#    still answering an earlier request when the client closes, fails that reply (EPIPE) and drops the
#    connection with the later requests (the held COMMIT) unread in its socket: the last puts are never
#    committed. Pre-existing for a commit sent right before close (bc7b7cc loses them too, same test),
#    but the change makes the last batch of every run of fast puts a commit that close() sends.
# ---------------------------------------------------------------------------------------------------

def test_close_after_fast_puts_commits_them(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.001, raising=False)
    reader = ShmTransport(worker.unix_path)
    lost = []
    try:
        for r in range(60):
            stager = stager_for(worker)
            keys = [[f"r{r}/{i}".encode()] for i in range(4)]
            blocks = [make_blocks(r * 10 + i, 64 << 10) for i in range(4)]
            assert stager.fits([64 << 10])
            for k, b in zip(keys, blocks):
                stager.put(k, [memoryview(b[0])])
            time.sleep(0.001 * (r % 3))
            stager.close()  # "a put still held is sent, not dropped"
            deadline = time.monotonic() + 1
            while time.monotonic() < deadline and not all(stored(reader, k, b) for k, b in zip(keys, blocks)):
                time.sleep(0.01)
            lost += [k[0] for k, b in zip(keys, blocks) if not stored(reader, k, b)]
    finally:
        reader.close()
    assert lost == [], f"{len(lost)} of 240 puts never committed after close(): {lost[:8]}"
    all_given_back(worker)


def _flusher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvpool-stage-flush"]


@pytest.mark.parametrize("hold_s", [0.0005, 0.002, 0.05])
def test_shapes_and_pins_varying_mid_stream(worker: Worker, monkeypatch: pytest.MonkeyPatch, hold_s: float) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", hold_s)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    shapes = [(64 << 10,), (64 << 10, 4096), (32 << 10,), (64 << 10,), (1 * MiB,)]
    rng = np.random.default_rng(0)
    puts = []
    try:
        for i in range(120):
            shape = shapes[(i // 7) % len(shapes)] if i % 11 else shapes[int(rng.integers(len(shapes)))]
            stager.fits(list(shape))
            keys = [f"k{i}/{j}".encode() for j in range(len(shape))]
            blocks = make_blocks(i, *shape)
            pin = [0.0, 30.0, 60.0][i % 3]
            places, sums = stager.put(keys, [memoryview(b) for b in blocks], pin_s=pin, hold=bool(i % 5 == 0))
            for p, b in zip(places, blocks):
                assert bytes(reader.arena[p.offset:p.offset + p.size]) == b.tobytes()
            puts.append((keys, blocks, pin))
            if i % 5 == 0 and i % 10:
                stager.send_held()
            if i % 13 == 0:
                time.sleep(0.003)
        stager.settle()
        for keys, blocks, _ in puts[-30:]:  # (older ones may be evicted)
            assert stored(reader, keys, blocks)
        assert protocol_errors(worker) == 0
    finally:
        stager.close()
    assert not _flusher_threads()
    all_given_back(worker)
    reader.close()


def test_same_key_twice_in_one_batch(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.3)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    try:
        assert stager.fits([64 << 10])
        first, second = make_blocks(1, 64 << 10), make_blocks(2, 64 << 10)
        stager.put([b"x"], [memoryview(make_blocks(0, 64 << 10)[0])])
        stager.put([b"k"], [memoryview(first[0])], pin_s=60)
        stager.put([b"k"], [memoryview(second[0])])
        stager.settle()
        assert stored(reader, [b"k"], second)
    finally:
        stager.close()
    all_given_back(worker)
    reader.close()


def test_refused_commit_inside_a_batch(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.3)
    bad = make_blocks(99, 64 << 10)
    monkeypatch.setattr(shm_stage, "copy_into", lying_about(bad[0]))
    monkeypatch.setitem(worker._handlers, P.Op.COMMIT_UNCHECKED, worker._commit)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    goods = [make_blocks(i, 64 << 10) for i in range(6)]
    try:
        assert stager.fits([64 << 10])
        stager.put([b"g0"], [memoryview(goods[0][0])])
        stager.put([b"g1"], [memoryview(goods[1][0])])
        stager.put([b"bad"], [memoryview(bad[0])])
        stager.put([b"g2"], [memoryview(goods[2][0])])
        with pytest.raises(CorruptBlock):
            stager.settle()
        stager.settle()  # raised once
        for i in (3, 4, 5):
            stager.put([f"g{i}".encode()], [memoryview(goods[i][0])])
        stager.settle()
        assert stored(reader, [f"g{i}".encode() for i in range(6)], [g[0] for g in goods])
    finally:
        stager.close()
    all_given_back(worker)
    reader.close()


def test_refused_commit_sent_by_the_flusher(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.02)
    bad = make_blocks(99, 64 << 10)
    monkeypatch.setattr(shm_stage, "copy_into", lying_about(bad[0]))
    monkeypatch.setitem(worker._handlers, P.Op.COMMIT_UNCHECKED, worker._commit)
    stager = stager_for(worker)
    try:
        assert stager.fits([64 << 10])
        stager.put([b"g0"], [memoryview(make_blocks(0, 64 << 10)[0])])
        stager.put([b"bad"], [memoryview(bad[0])])
        time.sleep(0.2)  # the flusher sends it
        with pytest.raises(CorruptBlock):
            stager.settle()
    finally:
        stager.close()
    all_given_back(worker)


def test_capacity_error_while_commits_are_held(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.3)
    filler = ShmTransport(worker.unix_path)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    try:
        for i in range(200):
            try:
                filler.batch_put([f"fill{i}".encode()], make_blocks(i, 4 * MiB - 4096), pin_s=60)
            except CapacityError:
                break
        assert stager.fits([256 << 10])
        got: list[tuple[list[bytes], list[np.ndarray]]] = []
        raised: CapacityError | None = None
        for i in range(40):
            keys, bl = [f"s{i}".encode()], make_blocks(1000 + i, 256 << 10)
            try:
                stager.put(keys, [memoryview(bl[0])], pin_s=60)
                got.append((keys, bl))
            except CapacityError as e:
                raised = e
                break
        assert raised is not None  # the worker ran out of room with commits held
        stager.settle()
        for keys, bl in got:
            assert stored(reader, keys, bl)
    finally:
        stager.close()
        filler.close()
    all_given_back(worker)
    reader.close()


def test_hold_without_send_held_then_close(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.002)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    blocks = [make_blocks(i, 64 << 10) for i in range(12)]
    try:
        assert stager.fits([64 << 10])
        for i, b in enumerate(blocks):
            stager.put([f"h{i}".encode()], [memoryview(b[0])], pin_s=10 * (i % 2), hold=True)
    finally:
        stager.close()
    wait_for(lambda: stored(reader, [f"h{i}".encode() for i in range(12)], [b[0] for b in blocks]))
    all_given_back(worker)
    reader.close()
