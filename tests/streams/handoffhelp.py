"""What the handoff checks share: a layer's bytes (the same for a tag and layer in every run), a
receiver's layers read and checked, a wait for a stream to hold so many messages, and a forger
publishing straight to NATS."""
from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from kvpool.core import nats_connect
from kvpool.streams import HandoffReceiver, stream_info


def layer_block(tag: str, layer: int, size: int) -> np.ndarray:
    return np.random.default_rng([sum(tag.encode()), layer]).integers(0, 256, size, dtype=np.uint8)


def receive_layers(rx: HandoffReceiver, request: str, size: int, timeout: float = 20) -> list[int]:
    """The layers of `request` as `rx` yields them, each checked: one block `request/L<layer>` holding
    `layer_block(request, layer, size)`."""
    got = []
    for layer, keys, bufs in rx.iter_layers(request, timeout=timeout):
        assert keys == [f"{request}/L{layer}"]
        assert bytes(bufs[0]) == layer_block(request, layer, size).tobytes()
        got.append(layer)
    return got


def wait_stored(url: str, stream: str, messages: int) -> None:
    """Wait (5 s at most) until `stream` holds `messages` messages."""
    deadline = time.monotonic() + 5
    while stream_info(url, stream)["messages"] != messages and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream_info(url, stream)["messages"] == messages


def forge(url: str, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
    """Publish (subject, body, headers) straight to NATS, as anyone allowed on the subjects could."""
    async def run() -> None:
        nc = await nats_connect(url, 5, logging.getLogger("test.forger"))
        try:
            for subj, body, headers in messages:
                await nc.publish(subj, body, headers=headers)
            await nc.flush()
        finally:
            await nc.close()
    asyncio.run(run())
