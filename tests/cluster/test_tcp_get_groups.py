"""A TCP get receives a frame's blocks a group at a time (one scatter receive for many) and checks each
block's checksum: a damaged block is a miss on its own, a block too large for its buffer is read and
dropped, and the connection stays in step either way."""
from __future__ import annotations

import numpy as np
import pytest

from kvpool.core import BufferSizeError, protocol
from kvpool.core.client import PoolClient


def _blocks(n: int, size: int, first: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(first, first + n)]


def test_groups_of_blocks_arrive_whole_and_checked(spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    w = spawn()
    blocks = _blocks(30, 100_000, 0) + _blocks(2, 3 << 20, 30) + _blocks(30, 7_000, 32)  # groups, and large blocks
    keys = [f"k{i}" for i in range(len(blocks))]
    real_checksum = protocol.checksum
    with PoolClient(mode="local", worker=w.address) as c:
        c.batch_put(keys, blocks)
        out = [np.zeros_like(b) for b in blocks]
        assert c.batch_get_into([*keys, "absent"], [*out, bytearray(8)]) == [b.nbytes for b in blocks] + [-1]
        assert all(np.array_equal(a, b) for a, b in zip(blocks, out))

        damaged = blocks[12].tobytes()[:32]
        monkeypatch.setattr(protocol, "checksum",  # block 12 arrives "damaged": its bytes do not hash right
                            lambda v: real_checksum(v) ^ (bytes(v[:32]) == damaged))
        sizes = c.batch_get_into(keys, [np.zeros_like(b) for b in blocks])
        assert sizes == [-1 if i == 12 else b.nbytes for i, b in enumerate(blocks)]
        assert c.backend.checksum_failures == 1  # type: ignore[attr-defined]  # a TcpTransport
        monkeypatch.setattr(protocol, "checksum", real_checksum)

        small = [np.zeros_like(b) for b in blocks]
        small[5] = np.zeros(10, dtype=np.uint8)
        small[40] = np.zeros(10, dtype=np.uint8)
        with pytest.raises(BufferSizeError, match="100000 bytes; the destination holds 10"):
            c.batch_get_into(keys, small)
        assert c.get("k31") == blocks[31].tobytes()  # the connection is in step
