"""Adversarial checks of the NATS roles (`kvpool.core.nats_creds.PERMISSIONS`) on a real nats-server set
up as `kvpool up` sets it up.

README, "NATS access": the `worker` role may "write its entry in `kvpool_members`, create the bucket,
publish block events" and "may not: configure other streams"; the one documented excess is that a
holder of the worker credentials can register any member."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats as nats_py
import pytest
from nats.js.api import RePublish
from nats.js.api import StreamConfig as NatsStreamConfig

from kvpool.core.nats_creds import authorization, ensure_creds, find_creds
from kvpool.core.nats_server import NatsServer
from kvpool.streams import StreamConfig, create_stream


@pytest.fixture
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NatsServer]:
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "state"))
    server = NatsServer(tmp_path / "state" / "nats", port=0, authorization=authorization(ensure_creds())).start()
    yield server
    server.stop()


def _as_worker(url: str, attack):  # type: ignore[no-untyped-def]
    async def run():  # type: ignore[no-untyped-def]
        creds = find_creds("worker")
        assert creds is not None
        nc = await nats_py.connect(url, allow_reconnect=False, connect_timeout=2, **creds.connect_options())
        try:
            return await attack(nc.jetstream(timeout=1))
        finally:
            await nc.close()
    return asyncio.run(run())


def test_the_worker_role_cannot_delete_a_users_stream(secured: NatsServer) -> None:
    create_stream(secured.url, "handoff", StreamConfig(memory=True))  # the admin's stream

    async def attack(js):  # type: ignore[no-untyped-def]
        with pytest.raises(nats_py.errors.TimeoutError):  # the server drops the request (Publish Violation)
            await js.delete_stream("handoff")
        return [s.config.name async for s in _names(js)]

    assert "handoff" in _as_worker(secured.url, attack)


def test_the_worker_role_cannot_make_a_stream_that_republishes_into_user_streams(secured: NatsServer) -> None:
    """A stream's republish writes as the server, past the user's publish permissions: a worker
    credential that may create streams may forge messages on any stream's subjects (and take over
    subjects of its own choosing), which the client role is kept from for exactly that reason."""
    async def attack(js):  # type: ignore[no-untyped-def]
        with pytest.raises(nats_py.errors.TimeoutError):
            await js.add_stream(NatsStreamConfig(
                name="EVIL", subjects=["kvpool.events.evil.x"],
                republish=RePublish(src="kvpool.events.evil.x", dest="kvpool.stream.handoff.forged")))

    _as_worker(secured.url, attack)


async def _names(js):  # type: ignore[no-untyped-def]
    for s in await js.streams_info():
        yield s
