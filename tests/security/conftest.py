"""Fixtures of the stream security tests: a stream per test and a pool of one real worker."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from kvpool.core import PoolClient
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.streams import StreamConfig, create_stream

_names = itertools.count()


@pytest.fixture
def stream(nats: NatsServer) -> str:
    name = f"sec{next(_names)}"
    create_stream(nats.url, name, StreamConfig())
    return name


@pytest.fixture
def pool(spawn: Callable[..., WorkerProcess], nats: NatsServer) -> Iterator[PoolClient]:
    """A cluster client of one real worker (max block 16 MiB on a 64 MiB arena)."""
    spawn(nats_url=nats.url)
    with PoolClient(mode="cluster", nats_url=nats.url) as c:
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        yield c
