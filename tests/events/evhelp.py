"""Helpers of the event tests: a ZMQ subscriber, vLLM's event classes (as its example subscriber
declares them, tagged arrays), and decoding with the installed vLLM's own classes."""
from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvpool.backends.engines import envs
from kvpool.core.events import EventFeed, EventIndex


class ArrayBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class ArrayAllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's `examples/online_serving/kv_events_subscriber.py` types (older vLLM's wire form)."""

    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class Subscriber:
    """A ZMQ SUB socket on `endpoint`, keeping every (topic, seq, payload) it receives."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.frames: list[tuple[bytes, int, bytes]] = []

    def poll(self, timeout_s: float) -> int:
        """Receive what arrives within `timeout_s`; the number of new messages."""
        n = 0
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                break
            topic, seq, payload = self.sock.recv_multipart()
            self.frames.append((topic, int.from_bytes(seq, "big"), payload))
            n += 1
        return n

    def until(self, done: Callable[[], bool], kick: Callable[[], None] | None = None, timeout_s: float = 20.0) -> None:
        """Receive until `done()`; `kick()` is called between polls (a PUB drops what it sends before
        the subscription reaches it, so a sync loop sends probes until one arrives)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"not done after {timeout_s} s ({len(self.frames)} messages)"
            if kick is not None:
                kick()
            self.poll(0.2)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class EngineDecode:
    """Payloads decoded by an installed engine's own event classes, in that engine's environment
    (built once per machine if missing): `script` prints them as one JSON list. Started at once, so
    several engines decode side by side; `result()` waits for the list."""

    def __init__(self, engine: str, script: str, payloads: list[bytes]) -> None:
        py = envs.ensure(engine)  # (built if missing; else only its kvpool pointed at this checkout)
        self.proc = subprocess.Popen([str(py), str(Path(__file__).with_name(script))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.payloads = "\n".join(p.hex() for p in payloads)

    def result(self) -> list[Any]:
        out, err = self.proc.communicate(self.payloads, timeout=300)
        assert self.proc.returncode == 0, err[-3000:]
        return list(json.loads(out.strip().splitlines()[-1]))


def decode_with_vllm(payloads: list[bytes]) -> list[Any]:
    """Events decoded by the installed vLLM's own `KVEventBatch`."""
    return EngineDecode("vllm", "vllm_decode.py", payloads).result()


def replay(url: str, until_keys: set[bytes], done: Callable[[EventIndex], bool] = lambda ix: True,
           timeout_s: float = 15.0) -> EventIndex:
    """Every retained event batch applied to an index, read until all of `until_keys` were named and
    `done(index)` holds."""
    index = EventIndex()
    with EventFeed(url, replay=True) as feed:
        while not (until_keys <= index.seen and done(index)):
            batch = feed.next_batch(timeout_s)
            assert batch is not None, f"events of {len(until_keys - index.seen)} keys never arrived"
            index.apply(batch)
    return index
