"""Corruption at rest and in flight: a damaged LMDB value (payload or header) and a flipped byte on
the wire (block data or frame metadata, either direction). Each is caught by a checksum, counted, and
costs a miss or a typed error for that block only; the pool serves everything else."""
from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

from kvpool.core import PoolUnavailable
from kvpool.core import protocol as P
from kvpool.core.blocks import checksum
from kvpool.core.client import PoolClient
from kvpool.core.errors import CorruptBlock
from kvpool.core.nats_server import free_port
from kvpool.core.procs import WorkerProcess

from faulthelp import block, metric, read_all
from flipproxy import FlipProxy

SIZE = 64 << 10
KEYS = [f"c{i}" for i in range(8)]


def _flip_in_file(path, needle: bytes, at: int) -> None:
    """Invert the byte `at` bytes into the one occurrence of `needle` in the file: bit rot."""
    raw = bytearray(path.read_bytes())
    pos = raw.find(needle)
    assert pos >= 0 and raw.find(needle, pos + 1) < 0, "needle not found exactly once"
    raw[pos + at] ^= 0xFF
    path.write_bytes(raw)


def test_corrupt_lmdb_values_are_counted_misses_after_restart(tmp_path):
    state = tmp_path / "w"
    w = WorkerProcess(state, ssd=True, dram_bytes="64MiB").wait_ready()
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            c.batch_put(KEYS, [block(k, SIZE) for k in KEYS])
    finally:
        assert w.stop() == 0, w.log_tail()  # SIGTERM flushes DRAM to the SSD tier
    data = state / "ssd" / "data.mdb"
    _flip_in_file(data, block("c3", SIZE)[1000:1064], 10)  # a payload byte
    c5, c6 = block("c5", SIZE), block("c6", SIZE)
    _flip_in_file(data, struct.pack("<QQ", SIZE, checksum(c5)), -8)  # the header's magic
    _flip_in_file(data, struct.pack("<QQ", SIZE, checksum(c6)), 16 + 8 + 7)  # the top byte of the block's version
    w = WorkerProcess(state, ssd=True, dram_bytes="64MiB").wait_ready()
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            _, misses = read_all(c, dict.fromkeys(KEYS, SIZE))
            assert sorted(misses) == ["c3", "c5", "c6"]  # c6 read as a block from far in the future, else
            assert c.stats().total.checksum_failures == 3
            assert c.batch_exists(["c3", "c5", "c6"]) == [False] * 3  # deleted, not served again
            c.batch_put(["c3", "c5", "c6"], [block("c3", SIZE), c5, c6])  # c6's write is not refused as older
            assert read_all(c, dict.fromkeys(KEYS, SIZE))[1] == []
    finally:
        w.stop()


def _damage_a_leaf_page(data, how: str) -> None:
    """Damage one of LMDB's own B-tree leaf pages (not a value): its type flags, or its first node's
    offset pointing past the page."""
    raw, page = bytearray(data.read_bytes()), 4096
    leaves = [p for p in range(2, len(raw) // page) if struct.unpack_from("<H", raw, p * page + 10)[0] == 0x02]
    p = leaves[len(leaves) // 2]
    if how == "flags":
        raw[p * page + 10] = 0x00
    else:
        struct.pack_into("<H", raw, p * page + 16, 0xFFF0)
    data.write_bytes(raw)


def test_a_damaged_lmdb_page_is_a_miss_when_read_and_a_clear_error_at_a_scan(tmp_path):
    """Read through the index saved at a clean stop, a damaged leaf page costs its blocks (counted
    misses) and the worker serves the rest; a start that must scan the headers refuses the tier with
    a StorageError that says what to do, not a traceback."""
    state, keys = tmp_path / "w", [f"k{i:04d}" for i in range(400)]
    w = WorkerProcess(state, ssd=True, dram_bytes="64MiB").wait_ready()
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            for i in range(0, len(keys), 100):
                c.batch_put(keys[i:i + 100], [block(k, 1024) for k in keys[i:i + 100]])
    finally:
        assert w.stop() == 0, w.log_tail()
    data = state / "ssd" / "data.mdb"
    _damage_a_leaf_page(data, "flags")
    w = WorkerProcess(state, ssd=True, dram_bytes="64MiB").wait_ready()
    try:
        with PoolClient(mode="local", worker=w.address) as c:
            hits, misses = read_all(c, dict.fromkeys(keys, 1024))
            assert 0 < len(misses) < 20 and len(hits) + len(misses) == len(keys)
            assert c.stats().total.checksum_failures >= len(misses)
        assert w.proc.poll() is None
        assert w.log_tail().count("Its LMDB file is damaged") == 1  # logged once
    finally:
        w.kill()  # no clean stop: the next start scans every header
    _damage_a_leaf_page(data, "offset")
    with pytest.raises(PoolUnavailable, match="StorageError: the SSD tier at .* is damaged .* move the folder aside"):
        WorkerProcess(state, ssd=True, dram_bytes="64MiB").wait_ready()


@pytest.fixture
def proxied(spawn):
    """(proxy, a client through the proxy, a client straight to the worker, the worker's metrics port)."""
    port = free_port()
    w = spawn(extra=["--metrics-port", str(port)])
    proxy = FlipProxy(("127.0.0.1", w.port))
    with PoolClient(mode="local", worker=proxy.address, timeout_s=5) as via, \
            PoolClient(mode="local", worker=w.address, timeout_s=5) as direct:
        via.batch_exists(["warm-up"])  # connect (HELLO) before anything is armed
        yield proxy, via, direct, port
    proxy.close()


def test_a_flipped_byte_in_a_get_reply_is_a_counted_miss(proxied):
    proxy, via, direct, _ = proxied
    direct.batch_put(KEYS, [block(k, SIZE) for k in KEYS])
    proxy.arm("down", P.HEADER.size + 24 * len(KEYS) + 3 * SIZE + 100)  # into c3's bytes
    bufs = [bytearray(SIZE) for _ in KEYS]
    sizes = via.batch_get_into(KEYS, bufs)
    assert proxy.flipped == 1
    assert sizes == [SIZE] * 3 + [-1] + [SIZE] * 4
    assert all(bytes(bufs[i]) == block(k, SIZE) for i, k in enumerate(KEYS) if i != 3)
    assert via.backend.checksum_failures == 1  # type: ignore[attr-defined]  # a TcpTransport
    assert read_all(via, dict.fromkeys(KEYS, SIZE))[1] == []  # in sync, and the stored block is fine


def test_a_flipped_byte_in_put_data_stores_nothing_wrong(proxied):
    proxy, via, direct, port = proxied
    blocks = [block(k, SIZE) for k in KEYS]
    meta = P.pack_batch([k.encode() for k in KEYS], *[np.zeros(len(KEYS), "<i8")] * 3)  # sizes, checksums, versions
    proxy.arm("up", P.HEADER.size + len(meta) + 5 * SIZE + 7)  # into c5's bytes
    with pytest.raises(CorruptBlock, match="arrived corrupt") as caught:
        via.batch_put(KEYS, blocks)
    assert caught.value.key == b"c5" and caught.value.size == SIZE
    assert proxy.flipped == 1
    assert direct.batch_exists(KEYS) == [True] * 5 + [False] + [True] * 2
    assert metric(port, "kvpool_corrupt_blocks_total") == 1
    via.batch_put(KEYS, blocks)  # the connection is still in sync
    assert read_all(direct, dict.fromkeys(KEYS, SIZE))[1] == []


def test_a_flipped_byte_in_frame_metadata_drops_only_that_connection(proxied):
    proxy, via, direct, port = proxied
    direct.batch_put(KEYS, [block(k, SIZE) for k in KEYS])
    proxy.arm("down", P.HEADER.size + 3)  # into the GET reply's sizes
    with pytest.raises(PoolUnavailable, match="checksum"):
        via.batch_get_into(KEYS, [bytearray(SIZE) for _ in KEYS])
    proxy.arm("up", P.HEADER.size + 2)  # into a request's key lengths: the worker refuses it
    with pytest.raises(PoolUnavailable):
        via.batch_exists(KEYS)
    assert metric(port, "kvpool_protocol_errors_total") == 1
    assert read_all(via, dict.fromkeys(KEYS, SIZE))[1] == []  # reconnected


def test_blocks_arriving_corrupt_again_and_again_are_one_warning(proxied, caplog):
    # A flaky link corrupting a block of every get had the client warn once per block per call: an
    # engine's log flooded. A warning a minute at most (the rest at debug level, counted in the next).
    proxy, via, direct, _ = proxied
    direct.batch_put(KEYS, [block(k, SIZE) for k in KEYS])
    bufs = [bytearray(SIZE) for _ in KEYS]
    with caplog.at_level(logging.DEBUG, logger="kvpool.transport"):
        for _ in range(5):
            proxy.arm("down", P.HEADER.size + 24 * len(KEYS) + 3 * SIZE + 100)
            assert via.batch_get_into(KEYS, bufs)[3] == -1
    corrupt = [r for r in caplog.records if "failed its checksum" in r.getMessage()]
    assert len(corrupt) == 5 and [r.levelno for r in corrupt].count(logging.WARNING) <= 1
