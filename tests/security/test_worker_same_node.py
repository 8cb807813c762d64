"""Same-node integrity: the worker verifies each block a same-node writer commits (a wrong checksum is
refused: CorruptBlock, counted), readers map the arena read-only, and a client maps only an arena of
its own user's with mode 0600 and the size the worker announced."""
from __future__ import annotations

import _posixshmem
import mmap
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from workerhelp import NOBODY, need_root

from kvpool.core import protocol as P
from kvpool.core.cli import _build_worker, build_parser
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import ConfigError, CorruptBlock, PoolUnavailable
from kvpool.core.server import Worker
from kvpool.core.tiers.dram import DramArena
from kvpool.core.transport import ShmTransport

SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock")), CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    yield w
    w.stop()


def test_a_same_node_commit_with_a_wrong_checksum_is_refused(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        data = b"the real bytes" * 100
        arena = t.writable_arena  # maps (and connects) outside the session below
        sizes = np.array([len(data)], "<i8")
        with t._session() as sock:
            offsets = np.frombuffer(t._roundtrip(sock, P.Op.ALLOC, P.pack_batch([b"forged"], sizes)).meta, dtype="<i8")
            off = int(offsets[0])
            arena[off:off + len(data)] = data
            lie = np.array([12345], dtype="<u8")  # not the checksum of what is in the slot
            commit = P.pack_batch([b"forged"], offsets, sizes, lie, np.array([1], "<u8"))
            reply = t._roundtrip(sock, P.Op.COMMIT, commit)
        assert np.frombuffer(reply.meta, dtype="<i1").tolist() == [P.ITEM_CORRUPT]
        assert worker.metrics.corrupt_blocks._value.get() == 1
        assert t.batch_exists([b"forged"]) == [False]
        assert worker.cache.stats().dram_bytes == 0  # the slot went back
        t.batch_put([b"honest"], [data])  # an honest writer on the same connection is served
        assert t.batch_get_into([b"honest"], [bytearray(len(data))]) == [len(data)]
    finally:
        t.close()


def test_a_block_changed_between_write_and_commit_is_refused(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        data = bytes(range(256)) * 16
        arena = t.writable_arena
        with t._session() as sock:
            sizes = np.array([len(data)], "<i8")
            offsets = np.frombuffer(t._roundtrip(sock, P.Op.ALLOC, P.pack_batch([b"k"], sizes)).meta, dtype="<i8")
            off = int(offsets[0])
            arena[off:off + len(data)] = data
            from kvpool.core.blocks import checksum

            csum = np.array([checksum(data)], dtype="<u8")
            arena[off] ^= 0xFF  # another writer scribbles before the commit
            reply = t._roundtrip(sock, P.Op.COMMIT, P.pack_batch([b"k"], offsets, sizes, csum, np.array([1], "<u8")))
        status = int(np.frombuffer(reply.meta, dtype="<i1")[0])
        from kvpool.core.connection import raise_item

        with pytest.raises(CorruptBlock):
            raise_item(status, b"k", len(data), worker.cache.max_block)
        with PoolClient(mode="local", worker=worker.unix_path) as c:
            assert c.get("k") is None
    finally:
        t.close()


def test_with_check_puts_first_read_a_wrong_checksum_is_a_miss_at_the_first_read(tmp_path: Path) -> None:
    """`check_puts="first_read"`: the worker commits a same-node writer's blocks on its checksum and hashes
    each at its first read; one whose bytes do not match is a miss there (counted, dropped), never served,
    and the writer's honest blocks read back."""
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), check_puts="first_read"),
               CacheConfig(**SMALL)).start()  # type: ignore[arg-type]
    t = ShmTransport(w.unix_path)
    try:
        data = b"the real bytes" * 100
        arena = t.writable_arena
        sizes = np.array([len(data)], "<i8")
        with t._session() as sock:
            offsets = np.frombuffer(t._roundtrip(sock, P.Op.ALLOC, P.pack_batch([b"forged"], sizes)).meta, dtype="<i8")
            off = int(offsets[0])
            arena[off:off + len(data)] = data
            commit = P.pack_batch([b"forged"], offsets, sizes, np.array([12345], "<u8"), np.array([1], "<u8"))
            reply = t._roundtrip(sock, P.Op.COMMIT, commit)
        assert np.frombuffer(reply.meta, dtype="<i1").tolist() == [P.ITEM_OK]  # committed on its word ...
        assert w.metrics.corrupt_blocks._value.get() == 0 and w.cache.stats().checksum_failures == 0
        t.batch_put([b"honest"], [data])
        out = bytearray(len(data))
        assert t.batch_get_into([b"forged", b"honest"], [out, bytearray(len(data))]) == [-1, len(data)]
        assert w.cache.stats().checksum_failures == 1  # ... and hashed at its first read: a miss, dropped
        assert t.batch_exists([b"forged", b"honest"]) == [False, True] and not any(out)
        assert w.cache.check() == []
    finally:
        t.close()
        w.stop()
    with pytest.raises(ConfigError, match="check_puts"):
        WorkerConfig(check_puts="sometimes")


def test_check_puts_comes_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path))
    args = build_parser().parse_args(["worker", "--port", "0", "--dram-bytes", "32MiB", "--check-puts", "first_read"])
    w = _build_worker(args)
    try:
        assert w.config.check_puts == "first_read" and w._handlers[P.Op.COMMIT] == w._commit_unchecked
    finally:
        w.stop()


def test_readers_map_the_arena_read_only(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        with PoolClient(mode="local", worker=worker.unix_path) as c:
            c.put("k", b"committed")
        assert t.arena.readonly
        with t.batch_lease([b"k"]) as views:
            view = views[0]
            assert view is not None and view.readonly and bytes(view) == b"committed"
            with pytest.raises(TypeError):
                view[0] = 0
            with pytest.raises(TypeError):
                t.arena[0] = 0
        assert t._arena_rw is None  # a reader never asked for a writable mapping
    finally:
        t.close()


def _shm(name: str, size: int, mode: int) -> None:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=mode)
    try:
        os.ftruncate(fd, size)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["mode", "size", "owner"])
def test_a_client_maps_only_its_own_users_0600_arena_of_the_announced_size(kind: str) -> None:
    if kind == "owner":
        need_root()
    name = f"kvpool-{os.getpid()}-{secrets.token_hex(4)}"
    size = 4 * mmap.PAGESIZE
    _shm(name, size if kind != "size" else size // 2, 0o644 if kind == "mode" else 0o600)
    try:
        if kind == "owner":
            os.chown(f"/dev/shm/{name}", NOBODY, NOBODY)
        with pytest.raises(PoolUnavailable, match="maps only its own user's 0600 arena"):
            DramArena.attach(name, size)
        with pytest.raises(PoolUnavailable):
            DramArena.attach(name, size, writable=True)
    finally:
        os.unlink(f"/dev/shm/{name}")
    _shm(name, size, 0o600)
    try:
        view = DramArena.attach(name, size)
        assert view.readonly and view.nbytes == size
        mapping = view.obj
        view.release()
        assert isinstance(mapping, mmap.mmap)
        mapping.close()
    finally:
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("how", ["same-node", "tcp"])
def test_verify_dram_reads_checks_every_read_a_worker_serves(tmp_path: Path, how: str) -> None:
    """`verify_dram_reads=True`: a block whose bytes changed in DRAM after its commit (bit rot, a stray
    write) is a miss on the worker's same-node and TCP read paths too, counted and dropped, never served."""
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock")),
               CacheConfig(**SMALL, verify_dram_reads=True)).start()  # type: ignore[arg-type]
    try:
        with PoolClient(mode="local", worker=w.unix_path if how == "same-node" else w.address) as c:
            c.batch_put(["rot", "fine"], [b"r" * 5000, b"f" * 5000])
            ref = w.cache.acquire("rot")
            assert ref is not None
            w.cache.arena.buf[ref.offset + 100] ^= 0xFF  # after the commit-time check
            w.cache.release(ref)
            out = [bytearray(5000), bytearray(5000)]
            assert c.batch_get_into(["rot", "fine"], out) == [-1, 5000] and bytes(out[1]) == b"f" * 5000
            assert c.batch_exists(["rot", "fine"]) == [False, True]
        assert w.cache.stats().checksum_failures == 1 and w.cache.check() == []
    finally:
        w.stop()
