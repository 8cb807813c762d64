"""936623a: a same-node put of at most `SOCKET_PUT_BYTES` goes in PUT frames over the Unix socket. The
slots a run of arena puts left reserved for a next put of its shape (`shm_put.SpareSlots`: "a put of
another shape gives them back first") are given back by an arena put of another shape, but a small put,
which goes the socket's way, leaves them reserved: a client that goes on with small puts keeps up to
`SPARE_BYTES` of the arena per connection reserved, unusable by anyone, until it closes."""
from __future__ import annotations

import numpy as np
from stagehelp import reserved_bytes, wait_for

from kvpool.core.server import Worker
from kvpool.core.transport import SOCKET_PUT_BYTES, ShmTransport

KiB = 1 << 10


def test_a_small_put_gives_back_the_slots_a_run_of_arena_puts_kept(worker: Worker) -> None:
    t = ShmTransport(worker.unix_path)
    try:
        large = [np.full(64 * KiB, i, dtype=np.uint8) for i in range(4)]  # 256 KiB: the arena's way
        assert sum(b.nbytes for b in large) > SOCKET_PUT_BYTES
        t.batch_put([f"a{i}".encode() for i in range(4)], large)
        t.batch_put([f"b{i}".encode() for i in range(4)], large)  # a run: slots kept for a third
        t.hello()  # (the answer read)
        wait_for(lambda: reserved_bytes(worker) == 256 * KiB)
        t.batch_put([b"small"], [np.full(16 * KiB, 7, dtype=np.uint8)])  # another shape, the socket's way
        t.hello()
        assert reserved_bytes(worker) == 0, f"{reserved_bytes(worker)} bytes of the arena still reserved"
    finally:
        t.close()
    wait_for(lambda: reserved_bytes(worker) == 0)
