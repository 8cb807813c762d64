"""A reader asks again, briefly, for a block its message names that the pool does not hold yet (a
producer's staged puts return before the worker commits them), and says it is missing after that."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvpool.core import PoolClient, checksum
from kvpool.streams import PayloadError, payload
from kvpool.streams.envelope import Ref


def _ref(data: np.ndarray) -> Ref:
    return Ref(["late"], [data.nbytes], [checksum(data)], "r", 0)


def test_a_block_committed_just_after_its_message_is_read() -> None:
    data = np.random.default_rng(1).integers(0, 256, 64 << 10, dtype=np.uint8)
    with PoolClient(mode="embedded", dram_bytes=16 << 20) as pool:
        late = threading.Timer(0.05, lambda: pool.batch_put(["late"], [data]))
        late.start()
        try:
            whole, _ = payload.fetch(pool, _ref(data))
        finally:
            late.join()
        assert bytes(whole) == data.tobytes()


def test_a_block_never_committed_is_missing_once_the_wait_is_over() -> None:
    data = np.zeros(4096, dtype=np.uint8)
    with PoolClient(mode="embedded", dram_bytes=16 << 20) as pool:
        t = time.monotonic()
        with pytest.raises(PayloadError, match="missing"):
            payload.fetch(pool, _ref(data))
        assert time.monotonic() - t >= payload.COMMITTING_S
