"""A call that leaves its exchange early drops its connection: a KeyboardInterrupt or an exception from
a signal handler while the reply is awaited, a destination that cannot take the bytes. Replies are told
apart by their operation alone, so a reply left unread would be taken by the next request of the kind
as its own, and serve another key's bytes (found by an adversarial check: `get("beta")` returned
alpha's bytes, and a key never stored returned beta's)."""
from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.errors import BufferSizeError
from kvpool.core.procs import WorkerProcess

from sigstop import freeze

A, B = b"A" * 100, b"B" * 100


class Deadline(Exception):
    """What a caller's own deadline (a SIGALRM handler) raises."""


def _alarm(signum: int, frame: object) -> None:
    raise Deadline("the caller's deadline")


@pytest.fixture
def clients(spawn: Callable[..., WorkerProcess]) -> Iterator[tuple[WorkerProcess, dict[str, PoolClient]]]:
    """A worker holding alpha and beta, and a client of it over shared memory and one over TCP."""
    worker = spawn()
    pools = {"shm": PoolClient(mode="local", worker=worker.unix_path),
             "tcp": PoolClient(mode="local", worker=worker.address)}
    pools["shm"].batch_put(["alpha", "beta"], [A, B])
    yield worker, pools
    for pool in pools.values():
        pool.close()


def _read(pool: PoolClient, key: str, into: bool) -> bytes | None:
    if not into:
        return pool.get(key)
    buf = bytearray(100)
    n = pool.get_into(key, buf)
    return None if n < 0 else bytes(buf[:n])


@pytest.mark.parametrize("into", [False, True], ids=["get", "get_into"])
@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_read_interrupted_while_its_reply_is_awaited_leaves_none_for_the_next(clients, path: str,
                                                                                into: bool) -> None:
    worker, pools = clients
    pool = pools[path]
    assert _read(pool, "beta", into) == B  # connected, and whatever a put left unread is read
    before = signal.signal(signal.SIGALRM, _alarm)
    freeze(worker.proc.pid)  # the request is sent, its reply does not come
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Deadline):
            _read(pool, "alpha", into)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        os.kill(worker.proc.pid, signal.SIGCONT)
    assert _read(pool, "beta", into) == B
    assert _read(pool, "beta", not into) == B
    assert _read(pool, "never-stored", into) is None
    assert _read(pool, "alpha", into) == A


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_strided_destination_is_refused_before_anything_is_asked(clients, path: str) -> None:
    _, pools = clients
    pool = pools[path]
    with pytest.raises(BufferSizeError, match="not contiguous"):
        pool.get_into("alpha", memoryview(bytearray(400))[::2])
    assert _read(pool, "beta", True) == B and _read(pool, "alpha", False) == A
