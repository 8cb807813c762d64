"""Fixtures for stream tests: streams on the test's nats-server, a worker in its cluster."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.streams import StreamConfig, create_stream

_names = itertools.count()


@pytest.fixture
def make_stream(nats: NatsServer) -> Callable[..., str]:
    """make_stream(**StreamConfig fields) -> the name of a new stream on the test's server."""
    def _make(**cfg: object) -> str:
        name = f"s{next(_names)}"
        create_stream(nats.url, name, StreamConfig(**cfg))  # type: ignore[arg-type]
        return name
    return _make


@pytest.fixture
def worker(spawn: Callable[..., WorkerProcess], nats: NatsServer) -> WorkerProcess:
    """One `kvpool worker` registered in the test's NATS cluster."""
    return spawn(nats_url=nats.url)


@pytest.fixture
def pool(nats: NatsServer, worker: WorkerProcess) -> Iterator[PoolClient]:
    """A cluster client of that worker, once it is listed."""
    with PoolClient(mode="cluster", nats_url=nats.url) as c:
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        yield c
