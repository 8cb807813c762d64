"""A message meant to go only on an idle connection (`Connection.supersede(idle=True)`, through
`FanOut.send_idle`): sent at once where the connection is open and unused, else `Busy` at once, having
sent nothing, opened nothing and waited on nothing; the connection stays usable."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool.core.connection import Busy
from kvpool.core.fanout import FanOut
from kvpool.core.records import WorkerInfo
from kvpool.core.server import Worker
from kvpool.core.transport import ShmTransport, TcpTransport
from kvpool.core.versions import CLOCK

BLOCK = np.full(4096, 7, dtype=np.uint8)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_an_idle_send_goes_on_an_open_unused_connection_only(worker: Worker, kind: str) -> None:
    t = ShmTransport(worker.unix_path) if kind == "shm" else TcpTransport(worker.address, worker.token)
    try:
        t.batch_put([b"a"], [BLOCK])
        t.supersede([b"a"], [CLOCK.now()], idle=True)  # open, unused: sent
        assert t.batch_exists([b"a"]) == [False]  # (the worker dropped its older block)
        t.batch_put([b"a"], [BLOCK])
        assert t._lock.acquire()  # an exchange of another thread under way
        try:
            started = time.monotonic()
            with pytest.raises(Busy):
                t.supersede([b"a"], [CLOCK.now()], idle=True)
            assert time.monotonic() - started < 0.1
        finally:
            t._lock.release()
        assert t.batch_exists([b"a"]) == [True]  # nothing was sent, and the connection still serves
        t.close()
        with pytest.raises(Busy):
            t.supersede([b"a"], [CLOCK.now()], idle=True)
        assert t._sock is None  # nothing opened
        assert t.batch_exists([b"a"]) == [True]  # an ordinary call opens it again
    finally:
        t.close()


def test_send_idle_reports_the_workers_it_reached(worker: Worker) -> None:
    fan = FanOut("elsewhere", worker.token, 5.0)
    live = {worker.worker_id: worker_info(worker)}
    groups = {worker.worker_id: [0]}
    calls: list[int] = []

    def tell(t: object, idx: list[int]) -> None:
        calls.append(len(idx))
        t.supersede([b"k"], [CLOCK.now()], idle=True)  # type: ignore[attr-defined]

    try:
        assert fan.send_idle(live, groups, tell) == set()  # no connection yet: none is made
        assert calls == []
        t = fan.transport(worker.worker_id, live[worker.worker_id])
        assert fan.send_idle(live, groups, tell) == set()  # made, not opened yet
        t.batch_exists([b"k"])  # opened by a call
        assert fan.send_idle(live, groups, tell) == {worker.worker_id}
        assert t._lock.acquire()
        try:
            assert fan.send_idle(live, groups, tell) == set()  # in use: left to the caller
        finally:
            t._lock.release()
        assert calls == [1, 1, 1]
    finally:
        fan.close()


def worker_info(worker: Worker) -> WorkerInfo:
    return WorkerInfo.from_dict(worker.info())
