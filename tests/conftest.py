"""Fixtures of every test: no KVPOOL_*/MOONCAKE_* settings leak in from the environment (the token
file is the test's own), no
shared-memory arena leaks out; real services on demand: nats-server on a free loopback port (temp
JetStream dir) and `kvpool worker` processes, always stopped, their arenas removed even if killed."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.core.tiers.dram import arena_names


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No KVPOOL_*/MOONCAKE_* settings from outside; the pool token file is the test's own, shared by the
    workers it starts (in process, or spawned: they inherit it) and found there by its clients."""
    for name in list(os.environ):
        if name.startswith(("KVPOOL_", "MOONCAKE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVPOOL_TOKEN_FILE", str(tmp_path / "kvpool-token"))


@pytest.fixture(autouse=True)
def _no_leaked_arena() -> Iterator[None]:
    before = arena_names()
    yield
    leaked = arena_names() - before
    for name in leaked:
        os.unlink(f"/dev/shm/{name}")
    assert not leaked, f"shared-memory arenas left behind: {sorted(leaked)}"


@pytest.fixture
def arena_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same-node puts of any size go through the arena, as large ones do (the tests of that path use
    small blocks; a small put would otherwise go through the socket: `transport.SOCKET_PUT_BYTES`)."""
    from kvpool.core import transport

    monkeypatch.setattr(transport, "SOCKET_PUT_BYTES", -1)


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats", port=0).start()
    yield server
    server.stop()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """spawn(**WorkerProcess options) -> a ready worker (64 MiB arena unless told); all are stopped at the end."""
    procs: list[WorkerProcess] = []

    def _spawn(**kw: object) -> WorkerProcess:
        kw.setdefault("dram_bytes", "64MiB")
        w = WorkerProcess(tmp_path / f"w{len(procs)}", **kw)  # type: ignore[arg-type]
        procs.append(w)
        return w.wait_ready()

    yield _spawn
    for w in procs:
        w.stop(timeout=5)
