"""Fixtures that start real services: nats-server on a free loopback port, `kvpool worker` processes."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats", port=0).start()
    yield server
    server.stop()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """spawn(**kw) -> a ready WorkerProcess; every one is stopped at the end of the test."""
    procs: list[WorkerProcess] = []

    def _spawn(**kw) -> WorkerProcess:
        w = WorkerProcess(tmp_path / f"w{len(procs)}", **kw)
        procs.append(w)
        return w.wait_ready()

    yield _spawn
    for w in procs:
        w.kill()
