"""A TCP put is handled per batch: the worker charges quota, reserves slots under one lock, receives
the blocks a group at a time (a large block chunk by chunk), checks every block's checksum and commits
the good ones together. A bad block is refused on its own (read whole, so the connection stays in
step); the good ones around it are stored; a tenant's quota and tally hold across the batch."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.blocks import checksum
from kvpool.core.procs import WorkerProcess
from kvpool.core.transport import TcpTransport, connect

TENANT_TOKEN = "tenant-a-token-" + "a" * 32
QUOTA = 64 << 10


def _block(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture
def session() -> Iterator[Callable[..., TcpTransport]]:
    """session(worker, token=None) -> a TCP connection to it, closed at the end."""
    opened: list[TcpTransport] = []

    def _open(w: WorkerProcess, token: str | None = None) -> TcpTransport:
        conn = connect(w.address, token, 10)
        assert isinstance(conn, TcpTransport)
        opened.append(conn)
        return conn

    yield _open
    for conn in opened:
        conn.close()


def _put(conn: TcpTransport, keys: list[bytes], blocks: list[bytes], csums: list[int] | None = None,
         versions: list[int] | None = None) -> list[int]:
    """A raw PUT frame (checksums as given, else right; versions as given, else 1, 2, ...): per-block statuses."""
    n = len(keys)
    meta = P.pack_batch(keys, np.array([len(b) for b in blocks], dtype="<i8"),
                        np.array(csums if csums is not None else [checksum(b) for b in blocks], dtype="<u8"),
                        np.array(versions if versions is not None else range(1, n + 1), dtype="<u8"))
    with conn._session() as sock:
        P.send_frame(sock, P.Op.PUT, meta, data=[memoryview(b) for b in blocks])
        reply = P.recv_reply(sock, P.Op.PUT)
    return np.frombuffer(reply.meta, dtype="<i1").tolist()


def _used(conn: TcpTransport) -> int:
    with conn._session() as sock:
        P.send_frame(sock, P.Op.STATS)
        reply = P.recv_reply(sock, P.Op.STATS)
    return int(P.unpack_json(reply.meta)["tenant"]["used_bytes"])


def test_bad_blocks_are_refused_alone_and_the_good_ones_stored(spawn: Callable[..., WorkerProcess],
                                                              session: Callable[..., TcpTransport]) -> None:
    w = spawn(dram_bytes="128MiB")
    conn = session(w)
    max_block = conn.max_block
    sizes = [16 << 10, 16 << 10, max_block + 1, 3 << 20, 1 << 20, 0, 7000, 600 << 10, 16 << 10]
    blocks = [_block(i, n) for i, n in enumerate(sizes)]
    keys = [f"k{i}".encode() for i in range(len(blocks))]
    csums = [checksum(b) for b in blocks]
    for bad in (1, 4, 7):  # small (in a group), large (hashed as it lands), and one just over a group's size
        csums[bad] ^= 1
    statuses = _put(conn, keys, blocks, csums)
    assert statuses == [P.ITEM_CORRUPT if i in (1, 4, 7) else P.ITEM_TOO_LARGE if i == 2 else P.ITEM_OK
                        for i in range(len(blocks))]
    got = conn.batch_get_into(keys, [bytearray(max(n, 1)) for n in sizes])
    assert got == [-1 if i in (1, 2, 4, 7) else n for i, n in enumerate(sizes)]
    out = [bytearray(n) for n in sizes]
    conn.batch_get_into([keys[i] for i in (0, 3, 6, 8)], [out[i] for i in (0, 3, 6, 8)])
    assert all(out[i] == blocks[i] for i in (0, 3, 6, 8))
    # the connection is in step, and the refused blocks can be put again
    assert _put(conn, [keys[1], keys[4]], [blocks[1], blocks[4]]) == [P.ITEM_OK, P.ITEM_OK]
    assert conn.batch_get_into([keys[4]], [out[4]]) == [1 << 20] and out[4] == blocks[4]


def _tenant_worker(tmp_path: Path, spawn: Callable[..., WorkerProcess]) -> WorkerProcess:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"a": {"token": TENANT_TOKEN, "quota_bytes": QUOTA}}))
    path.chmod(0o600)
    return spawn(extra=["--tenants", str(path)])


def test_a_tenants_quota_holds_across_a_batch(tmp_path: Path, spawn: Callable[..., WorkerProcess],
                                             session: Callable[..., TcpTransport]) -> None:
    w = _tenant_worker(tmp_path, spawn)
    a = session(w, TENANT_TOKEN)
    keys = [f"a/{i}".encode() for i in range(6)]
    blocks = [_block(i, 16 << 10) for i in range(6)]
    csums = [checksum(b) for b in blocks]
    csums[1] ^= 1  # corrupt: not stored; its charge held while the batch was charged, given back after
    assert _put(a, keys, blocks, csums) == [0, P.ITEM_CORRUPT, 0, 0, P.ITEM_QUOTA, P.ITEM_QUOTA]
    assert _used(a) == 3 * (16 << 10)
    assert _put(a, [keys[4], keys[5]], [blocks[4], blocks[5]]) == [0, P.ITEM_QUOTA]  # room for one more
    assert _used(a) == QUOTA
    out = [bytearray(16 << 10) for _ in keys]
    assert a.batch_get_into(keys, out) == [16 << 10 if i in (0, 2, 3, 4) else -1 for i in range(6)]
    assert all(out[i] == blocks[i] for i in (0, 2, 3, 4))
    assert "would pass its quota" in w.log_tail(1 << 16)


def test_a_key_named_twice_in_a_batch_is_tallied_as_stored(tmp_path: Path, spawn: Callable[..., WorkerProcess],
                                                          session: Callable[..., TcpTransport]) -> None:
    w = _tenant_worker(tmp_path, spawn)
    a = session(w, TENANT_TOKEN)
    big, small = _block(1, 16 << 10), _block(2, 8 << 10)
    # the second copy is older than the first: not stored (superseded), and the tally keeps the first one's size
    assert _put(a, [b"a/x", b"a/x"], [big, small], versions=[20, 10]) == [0, P.ITEM_SUPERSEDED]
    assert _used(a) == 16 << 10
    out = bytearray(16 << 10)
    assert a.batch_get_into([b"a/x"], [out]) == [16 << 10] and out == big
    # the second copy newer: it replaces the first, and the tally follows
    assert _put(a, [b"a/y", b"a/y"], [big, small], versions=[30, 40]) == [0, 0]
    assert _used(a) == (16 << 10) + (8 << 10)
