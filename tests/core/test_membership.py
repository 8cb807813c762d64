"""Membership against a real nats-server: who is live, and who was heard from (what a worker back from
an absence asks for the changes it missed)."""
from __future__ import annotations

import asyncio
import threading
import time

import nats as nats_py
from nats.js.api import StreamConfig

from kvpool.core.cluster import BUCKET, Membership


def test_a_worker_that_left_is_still_heard_since_before_it_left(nats):
    watcher = Membership(nats.url, ttl_s=3.0, role="worker")
    try:
        watcher.watch()
        before = time.monotonic()
        peer = Membership(nats.url, ttl_s=3.0, role="worker")
        try:
            peer.register("w-peer", lambda: {"tcp": "127.0.0.1:1"}, heartbeat_s=0.5)
            assert watcher.wait_for(lambda m: "w-peer" in m, 5)
        finally:
            peer.close()  # deletes its entry: no longer a member
        assert watcher.wait_for(lambda m: "w-peer" not in m, 5)
        heard = watcher.heard_since(before)
        assert list(heard) == ["w-peer"] and heard["w-peer"].tcp == "127.0.0.1:1"  # it may have taken writes
        assert watcher.heard_since(time.monotonic()) == {}  # nothing heard since it left
        peer.close()  # a second close does nothing
    finally:
        watcher.close()


def test_a_worker_registers_once_jetstream_takes_it(nats):
    """Right after a NATS cluster creates the member bucket, its stream answers nothing until the cluster
    has elected its leader ("no response from stream"): a starting worker tries again (for up to
    REGISTER_S) rather than exit. Here the bucket's stream is gone for a second, then back."""
    async def drop_stream() -> StreamConfig:
        nc = await nats_py.connect(nats.url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(f"KV_{BUCKET}")
            await js.delete_stream(f"KV_{BUCKET}")
            return info.config
        finally:
            await nc.close()

    async def restore(config: StreamConfig) -> None:
        nc = await nats_py.connect(nats.url)
        try:
            await nc.jetstream().add_stream(config)
        finally:
            await nc.close()

    worker = Membership(nats.url, ttl_s=3.0, role="worker")  # opens (creates) the bucket
    try:
        config = asyncio.run(drop_stream())
        back = threading.Timer(1.0, lambda: asyncio.run(restore(config)))
        back.start()
        started = time.monotonic()
        worker.register("w-late", lambda: {"tcp": "127.0.0.1:1"}, heartbeat_s=0.5)
        assert time.monotonic() - started >= 0.9  # it waited for the stream ...
        assert "w-late" in worker.peers()  # ... and is registered
        back.join()
    finally:
        worker.close()
