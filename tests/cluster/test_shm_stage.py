"""Staged same-node puts (`kvpool.core.shm_stage`): they land where they say, the next put's slots are
kept for a put of the same shape and given back otherwise and at close, a held put is committed (pinned)
once sent and not before, the commits of fast puts go together (sent by the stager's own thread when its
producer does not come back, and at once after a pause), a block whose bytes disagree with its checksum
is a miss at its first read through the worker (same node or TCP), a commit the worker refuses raises
from a later put or settle (and the stager goes on), no room is a CapacityError with nothing held, and
`Stagers` stages only what a same-node worker alone holds."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from stagehelp import (
    all_given_back,
    lying_about,
    make_blocks,
    requests_of,
    reserved_bytes,
    stager_for,
    stored,
    wait_for,
)

from kvpool.core import PoolClient, shm_stage
from kvpool.core import protocol as P
from kvpool.core.blocks import checksum
from kvpool.core.errors import CapacityError, CorruptBlock, PoolUnavailable
from kvpool.core.fastcopy import copy_into
from kvpool.core.server import Worker
from kvpool.core.shm_stage import LOOKAHEAD, Stagers
from kvpool.core.transport import ShmTransport, TcpTransport

MiB = 1 << 20
















def test_staged_puts_land_where_they_say_and_spare_slots_follow_the_shape(worker: Worker) -> None:
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    try:
        layers = [(f"L{i}/a".encode(), f"L{i}/b".encode()) for i in range(3)]
        blocks = [make_blocks(0, 256 << 10, 256 << 10), make_blocks(1, 256 << 10, 256 << 10),
                  make_blocks(2, 1 * MiB, 4096)]
        staged = [stager.put(list(keys), [memoryview(b) for b in bl]) for keys, bl in zip(layers, blocks)]
        stager.settle()
        places = [p for p, _ in staged]
        assert [sums for _, sums in staged] == [[checksum(b) for b in bl] for bl in blocks]
        for keys, bl, pl in zip(layers, blocks, places):
            assert stored(reader, list(keys), bl)
            for b, p in zip(bl, pl):  # the place is the committed block's slot, as a same-node reader copies it
                assert bytes(reader.arena[p.offset:p.offset + p.size]) == b.tobytes()
        assert reserved_bytes(worker) == LOOKAHEAD * (MiB + 4096)  # spare puts' worth, of the last put's shape
    finally:
        stager.close()
    all_given_back(worker)  # the spare went back
    reader.close()


def test_a_held_put_is_committed_pinned_once_sent_and_not_before(worker: Worker) -> None:
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    first, second, last = make_blocks(3, 64 << 10), make_blocks(4, 64 << 10), make_blocks(5, 64 << 10)
    try:
        (place,), _ = stager.put([b"first"], [memoryview(first[0])], pin_s=60, hold=True)
        assert bytes(reader.arena[place.offset:place.offset + place.size]) == first[0].tobytes()  # in place ...
        assert not stored(reader, [b"first"], first)  # ... but not committed: nothing was sent
        assert worker.cache.stats().pins == 0
        stager.send_held()  # pin, commit and the next put's slots, in one send
        stager.settle()
        assert stored(reader, [b"first"], first) and worker.cache.stats().pins == 1
        stager.put([b"second"], [memoryview(second[0])], hold=True)
        stager.put([b"last"], [memoryview(last[0])], hold=True)  # sends the one held before it first
        stager.settle()  # sends the last one held
        assert stored(reader, [b"second", b"last"], second + last)
        stager.put([b"closing"], [memoryview(first[0])], hold=True)
    finally:
        stager.close()  # a put still held is sent, not dropped
    wait_for(lambda: stored(reader, [b"closing"], first))
    all_given_back(worker)
    reader.close()


def test_a_staged_block_whose_bytes_disagree_is_a_miss_at_its_first_read(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    bad, good = make_blocks(5, 64 << 10), make_blocks(6, 64 << 10)
    monkeypatch.setattr(shm_stage, "copy_into", lying_about(bad[0]))
    stager, reader, remote = stager_for(worker), ShmTransport(worker.unix_path), TcpTransport(worker.address)
    try:
        stager.put([b"bad"], [memoryview(bad[0])])
        stager.put([b"good"], [memoryview(good[0])])
        stager.settle()  # committed unchecked: the worker hashes a block at its first read, not here
        out = np.zeros(64 << 10, dtype=np.uint8)
        assert reader.batch_get_into([b"bad"], [out]) == [-1]  # the lease found it corrupt: a miss ...
        assert remote.batch_get_into([b"bad"], [out]) == [-1]  # ... and it was dropped
        assert stored(reader, [b"good"], good) and stored(remote, [b"good"], good)
        assert worker.cache.stats().checksum_failures == 1
    finally:
        stager.close()
        reader.close()
        remote.close()


def test_a_remote_first_read_checks_a_staged_block_too(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = make_blocks(5, 64 << 10)
    monkeypatch.setattr(shm_stage, "copy_into", lambda d, o, s: copy_into(d, o, s) ^ 1)  # lies for every block
    stager, remote = stager_for(worker), TcpTransport(worker.address)
    try:
        stager.put([b"bad"], [memoryview(bad[0])])
        stager.settle()
        assert remote.batch_get_into([b"bad"], [np.zeros(64 << 10, dtype=np.uint8)]) == [-1]
        assert worker.cache.stats().checksum_failures == 1  # the worker's check, not the client's
        assert remote.checksum_failures == 0
    finally:
        stager.close()
        remote.close()


def test_a_refused_commit_raises_from_the_next_put_and_the_stager_goes_on(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    bad, good, later = make_blocks(5, 64 << 10), make_blocks(6, 64 << 10), make_blocks(7, 64 << 10)
    monkeypatch.setattr(shm_stage, "copy_into", lying_about(bad[0]))
    monkeypatch.setitem(worker._handlers, P.Op.COMMIT_UNCHECKED, worker._commit)  # a worker that checks at once
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    try:
        stager.put([b"bad"], [memoryview(bad[0])])  # returns: the worker has not answered yet
        with pytest.raises(CorruptBlock):
            stager.put([b"good"], [memoryview(good[0])])
        assert not stored(reader, [b"good"], good)  # the put that raised stored nothing ...
        stager.put([b"good"], [memoryview(good[0])])  # ... and the stager goes on
        stager.put([b"bad"], [memoryview(bad[0])])
        with pytest.raises(CorruptBlock):
            stager.settle()
        stager.put([b"later"], [memoryview(later[0])])
        stager.settle()
        assert stored(reader, [b"good", b"later"], good + later)
        assert reader.batch_get_into([b"bad"], [np.zeros(64 << 10, dtype=np.uint8)]) == [-1]
    finally:
        stager.close()
        reader.close()


def test_no_room_is_a_capacity_error_with_nothing_held(worker: Worker) -> None:
    filler = ShmTransport(worker.unix_path)
    stager = stager_for(worker)
    try:
        with pytest.raises(CapacityError):
            for i in range(200):  # pinned: nothing can be evicted for the stager
                filler.batch_put([f"fill{i}".encode()], make_blocks(i, 4 * MiB - 4096), pin_s=60)
        with pytest.raises(CapacityError):
            stager.put([b"x"], [memoryview(make_blocks(9, 4 * MiB - 4096)[0])])
        assert reserved_bytes(worker) == 0
    finally:
        stager.close()
        filler.close()


def test_stagers_stage_only_a_same_node_workers_blocks_that_fit(worker: Worker) -> None:
    with PoolClient(mode="local", worker=worker.unix_path) as local, \
            PoolClient(mode="embedded", dram_bytes=16 * MiB) as embedded:
        stagers = Stagers(local)
        try:
            assert stagers.for_keys([b"k"], [MiB]) is not None
            assert stagers.for_keys([b"k"], [MiB]) is stagers.for_keys([b"j"], [4096])  # one per worker
            assert stagers.for_keys([b"k"], [local.backend.hello().max_reserve]) is None  # no room for a spare too
            assert stagers.for_keys([], []) is None
        finally:
            stagers.close()
        assert Stagers(embedded).for_keys([b"k"], [MiB]) is None


def test_fast_puts_commit_together_and_the_stager_sends_them_if_its_producer_does_not(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.3)  # (so that the puts below surely come within it)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    blocks = [make_blocks(10 + i, 64 << 10) for i in range(5)]
    keys = [[f"fast{i}".encode()] for i in range(5)]
    try:
        assert stager.fits([64 << 10])  # room for shm_stage.HOLD_PUTS of them held
        before = requests_of(worker, "commit_unchecked")
        placed = [stager.put(k, [memoryview(b[0])], pin_s=60) for k, b in zip(keys, blocks)]
        assert requests_of(worker, "commit_unchecked") - before <= 1  # the first, after a pause: at once
        for ((place,), _), block in zip(placed, blocks):  # each in its place (a reader on this node copies it)
            assert bytes(reader.arena[place.offset:place.offset + place.size]) == block[0].tobytes()
        assert not stored(reader, keys[-1], blocks[-1])  # ... but not committed yet
        held_at = time.monotonic()
        wait_for(lambda: stored(reader, sum(keys, []), sum(blocks, [])))  # no call of the producer's
        assert time.monotonic() - held_at >= 0.1  # (held, then sent by the stager's thread)
        wait_for(lambda: requests_of(worker, "commit_unchecked") - before >= 2)  # (counted after the answer)
        assert requests_of(worker, "commit_unchecked") - before == 2  # the first; the other four together
        assert worker.cache.stats().pins == 5
    finally:
        stager.close()
    assert not [t for t in threading.enumerate() if t.name == "kvpool-stage-flush"]  # its thread ended
    all_given_back(worker)
    reader.close()


def test_a_producer_putting_at_a_steady_pace_sends_its_held_commits_itself_in_time(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.2)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    by_thread = []
    real_send = stager._send_held

    def send_held(sock: socket.socket) -> None:
        if stager._held.puts:
            by_thread.append((threading.current_thread().name, time.monotonic() - stager._held.since))
        real_send(sock)
    stager._send_held = send_held  # type: ignore[method-assign]
    try:
        assert stager.fits([64 << 10])
        for i in range(16):
            stager.put([f"paced{i}".encode()], [memoryview(make_blocks(50 + i, 64 << 10)[0])])
            time.sleep(0.03)  # a layer every 30 ms: several within HOLD_S, never HOLD_S apart
        sent, held = list(by_thread), stager._held.puts
        assert 3 <= len(sent) < 16  # together, not one by one (the first at once: it came after a pause)
        assert all(name == threading.current_thread().name for name, _ in sent)  # none by the stager's thread
        assert all(age < shm_stage.HOLD_S for _, age in sent)  # ... sent before HOLD_S old
        if held:  # the producer stopped: the stager's thread sends the rest
            wait_for(lambda: len(by_thread) > len(sent))
            assert by_thread[-1][0] == "kvpool-stage-flush"
        assert stored(reader, [f"paced{i}".encode() for i in range(16)],
                      [make_blocks(50 + i, 64 << 10)[0] for i in range(16)])
    finally:
        stager.close()
        reader.close()


def test_a_put_after_a_pause_is_committed_at_once(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.002)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    try:
        assert stager.fits([64 << 10])
        before = requests_of(worker, "commit_unchecked")
        for i in range(3):
            time.sleep(0.02)  # a producer slower than HOLD_S
            stager.put([f"slow{i}".encode()], [memoryview(make_blocks(20 + i, 64 << 10)[0])])
        stager.settle()
        wait_for(lambda: requests_of(worker, "commit_unchecked") - before >= 3)  # (counted after the answer)
        assert requests_of(worker, "commit_unchecked") - before == 3
    finally:
        stager.close()
        reader.close()


def test_commits_held_when_the_connection_breaks_fail_the_next_call(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_stage, "HOLD_S", 0.05)
    stager, reader = stager_for(worker), ShmTransport(worker.unix_path)
    try:
        assert stager.fits([64 << 10])
        for i in range(3):
            stager.put([f"lost{i}".encode()], [memoryview(make_blocks(30 + i, 64 << 10)[0])])
        for conn in list(worker._conns):  # the worker drops the stager's connection (and reader's)
            socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
        time.sleep(0.2)  # the stager's thread tries to send the held commits, and finds it closed
        with pytest.raises(PoolUnavailable):
            stager.settle()
        assert not worker.metrics.registry.get_sample_value("kvpool_protocol_errors_total")  # nothing stale sent
        later = make_blocks(40, 64 << 10)
        stager.put([b"later"], [memoryview(later[0])])  # and it goes on, on a new connection
        stager.settle()
        assert stored(reader, [b"later"], later)
    finally:
        stager.close()
        reader.close()
    all_given_back(worker)
