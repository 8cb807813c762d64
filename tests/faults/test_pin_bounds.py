"""PIN frames cannot exhaust a worker: pins on keys that never arrive are bounded in number and time,
renewals do not pile up, and a frame is handled in time linear in its keys."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.client import PoolClient
from kvpool.core.errors import KVPoolError
from kvpool.core.pins import MAX_PENDING_PINS
from kvpool.core.transport import TcpTransport

from faulthelp import bounded, heap_bytes


def _pin_frame(address: str, keys: list[bytes], seconds: np.ndarray) -> None:
    """One hand-made PIN frame of any size, on an authenticated connection."""
    t = TcpTransport(address, timeout_s=30)
    try:
        with t._session() as s:
            P.send_frame(s, P.Op.PIN, P.pack_batch(keys, seconds.astype("<f8")))
            P.send_frame(s, P.Op.STATS)  # the worker handles a connection's frames in order
            P.recv_reply(s, P.Op.STATS)
    finally:
        t.close()


def _stats(c: PoolClient) -> dict[str, int]:
    return c.stats().total.as_dict()


def test_pins_on_absent_keys_are_bounded_and_a_put_keeps_its_pin(spawn) -> None:
    w = spawn()
    addr = w.address
    with PoolClient(mode="local", worker=w.address) as c:
        rss0 = heap_bytes(w.proc.pid)
        for r in range(4):  # 4 x 50,000 distinct absent keys, a pin of an hour each
            keys = [f"ghost/{r}/{i}".encode() for i in range(50_000)]
            _pin_frame(addr, keys, np.full(len(keys), 3600.0))
        s = _stats(c)
        assert s["pending_pins"] == MAX_PENDING_PINS and s["pins_refused"] == 200_000 - MAX_PENDING_PINS
        assert heap_bytes(w.proc.pid) - rss0 < 64 << 20
        # a put that carries a pin still gets it (the pin waits for its block, then runs its length)
        c.batch_put(["kept"], [b"x" * 4096], pin_s=600)
        s = _stats(c)
        assert s["pins"] >= 1 and c.get("kept") == b"x" * 4096


def test_renewed_pins_do_not_grow_the_worker(spawn) -> None:
    w = spawn()
    with PoolClient(mode="local", worker=w.address) as c:
        keys = [f"k{i}" for i in range(1000)]
        c.batch_put(keys, [b"v" * 256] * len(keys))
        rss0 = heap_bytes(w.proc.pid)
        for _ in range(300):  # 300,000 renewals of the same 1,000 pins
            c.batch_pin(keys, 600)
        assert _stats(c)["pins"] == 1000
        assert heap_bytes(w.proc.pid) - rss0 < 16 << 20


def test_a_frame_of_distinct_durations_is_linear(spawn) -> None:
    w = spawn()
    keys = [f"d{i}".encode() for i in range(20_000)]
    with bounded(10.0, "a PIN frame of 20,000 distinct durations"):  # quadratic took minutes
        _pin_frame(w.address, keys, np.linspace(1, 3000, len(keys)))
    with PoolClient(mode="local", worker=w.address) as c:
        assert _stats(c)["pending_pins"] == len(keys)


def test_a_pin_of_no_finite_length_closes_its_connection_and_other_pins_still_expire(spawn) -> None:
    w = spawn()
    with PoolClient(mode="local", worker=w.address) as c:
        c.batch_put(["nan", "short"], [b"n" * 256, b"s" * 256])
        with pytest.raises(KVPoolError):  # the worker drops a connection that sends a malformed frame
            _pin_frame(w.address, [b"nan"], np.array([np.nan]))
        c.pin("short", 0.2)
        time.sleep(0.4)
        c.pin("other", 0.0)  # any pin call applies the deadlines that have passed
        assert _stats(c)["pins"] == 0  # a NaN deadline at the heap's top held back every later one
