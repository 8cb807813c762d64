"""The pool's block events in vLLM's KV-event format, published on a ZMQ PUB socket.

Cache-aware routers (vLLM's own subscriber example, NVIDIA Dynamo's KV router, llm-d's indexer)
read engines' events as ZMQ multipart messages `(topic, seq: 8-byte big-endian, payload)`, the
payload a msgpack array `[ts, [event, ...], dp_rank]`, each event a `BlockStored`, `BlockRemoved` or
`AllBlocksCleared`. kvpool's block events map onto them so a router can route on what the whole pool
holds: a block entering the pool is a `BlockStored` with the tier as `medium` (DRAM "CPU", SSD
"STORAGE"), a block leaving the pool (removed, evicted out of its last tier, expired, corrupt) a
`BlockRemoved`, `clear()` an `AllBlocksCleared`. Moves between tiers are not events for a router that
ignores `medium` (the block is still in the pool); `tier_moves=True` adds them, as a `BlockStored` in
the new tier and a `BlockRemoved` in the old one, for routers that track media.

The block hash is the engine's own: the last 64-hex-digit run in the key (vLLM connector keys
`vllm/<sha256>`, SGLang page hashes), as 32 bytes, else the SHA-256 of the whole key; with
`block_hash="int"` the low 64 bits of it as vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` makes them
(Dynamo reads 64-bit ints only). The pool knows neither token ids nor the parent block: events carry
`token_ids=[]` and `parent_block_hash=None`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

from .errors import ConfigError
from .events import EventBatch

__all__ = ["MEDIUM", "LAYOUTS", "HASHES", "VllmFormat", "block_hash", "vllm_events", "encode", "ZmqSink"]

MEDIUM = {"dram": "CPU", "ssd": "STORAGE"}
LAYOUTS = ("map", "array")
HASHES = ("bytes", "int")
_HEX64 = re.compile(rb"(?<![0-9a-fA-F])[0-9a-fA-F]{64}(?![0-9a-fA-F])")


@dataclasses.dataclass
class VllmFormat:
    """How events are written. `layout`: "map" (events as tagged maps: vLLM's current
    `vllm.distributed.kv_events` classes, Dynamo) or "array" (tagged arrays: older vLLM and its
    `kv_events_subscriber.py` example, Dynamo). `block_tokens`: the engine's block size in tokens."""

    layout: str = "map"
    block_hash: str = "bytes"
    block_tokens: int = 16
    tier_moves: bool = False
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"event layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.block_hash not in HASHES:
            raise ConfigError(f"block hash form {self.block_hash!r} is not one of {', '.join(HASHES)}")
        if self.block_tokens < 1:
            raise ConfigError(f"block_tokens {self.block_tokens} must be >= 1 (the engine's tokens per block)")


def block_hash(key: bytes, form: str = "bytes") -> bytes | int:
    """The engine's block hash named by a pool key (see the module docstring)."""
    found = _HEX64.findall(key)
    digest = bytes.fromhex(found[-1].decode()) if found else hashlib.sha256(key).digest()
    return digest if form == "bytes" else int.from_bytes(digest, "big") & ((1 << 64) - 1)


def _stored(fmt: VllmFormat, hashes: list[Any], medium: str) -> Any:
    if fmt.layout == "array":
        return ["BlockStored", hashes, None, [], fmt.block_tokens, None, medium, None]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": fmt.block_tokens, "lora_id": None, "medium": medium, "lora_name": None}


def _removed(fmt: VllmFormat, hashes: list[Any], medium: str) -> Any:
    if fmt.layout == "array":
        return ["BlockRemoved", hashes, medium]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def _cleared(fmt: VllmFormat) -> Any:
    return ["AllBlocksCleared"] if fmt.layout == "array" else {"type": "AllBlocksCleared"}


def vllm_events(batch: EventBatch, fmt: VllmFormat) -> list[Any]:
    """The vLLM events of one kvpool batch, in order: one BlockStored per block (the pool does not
    know which blocks chain), consecutive removals from one medium merged into one BlockRemoved."""
    out: list[Any] = []
    removing: tuple[str, list[Any]] | None = None  # the BlockRemoved being merged into
    last_stored: tuple[Any, str] | None = None  # K and V parts of one page name the same hash
    for e in batch.events:
        kind = e.kind
        if fmt.tier_moves and kind in ("copied", "dropped"):
            kind = "stored" if kind == "copied" else "removed"
        if kind == "cleared":
            out.append(_cleared(fmt))
            removing = last_stored = None
        elif kind == "stored":
            h, medium = block_hash(e.key, fmt.block_hash), MEDIUM.get(e.tier, e.tier.upper())
            if last_stored != (h, medium):
                out.append(_stored(fmt, [h], medium))
            last_stored, removing = (h, medium), None
        elif kind == "removed":
            h, medium = block_hash(e.key, fmt.block_hash), MEDIUM.get(e.tier, e.tier.upper())
            if removing is not None and removing[0] == medium:
                if removing[1][-1] != h:
                    removing[1].append(h)
            else:
                removing = (medium, [h])
                out.append(_removed(fmt, removing[1], medium))
            last_stored = None
    return out


def encode(ts: float, events: list[Any], fmt: VllmFormat) -> bytes:
    """msgpack of vLLM's `KVEventBatch`: `[ts, events, dp_rank]`."""
    import msgspec

    return msgspec.msgpack.encode([ts, events, fmt.dp_rank])


class ZmqSink:
    """Binds a ZMQ PUB socket at `endpoint` (e.g. `tcp://127.0.0.1:5557`, `tcp://*:5557`) and sends
    each batch's vLLM events as `(topic, seq, payload)`, `seq` counting messages from 0 as vLLM's
    publisher does. Needs `pip install -e '.[events]'` (pyzmq, msgspec)."""

    def __init__(self, endpoint: str, fmt: VllmFormat | None = None, topic: str = "", hwm: int = 100_000) -> None:
        try:
            import msgspec  # noqa: F401
            import zmq
        except ImportError as e:
            raise ConfigError(f"ZMQ events need pyzmq and msgspec: pip install -e '.[events]' ({e})") from e
        self.fmt = fmt or VllmFormat()
        self.topic = topic.encode()
        self.seq = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"cannot bind ZMQ events at {endpoint!r}: {e}") from e
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def __call__(self, batch: EventBatch) -> None:
        events = vllm_events(batch, self.fmt)
        if events:
            self.send(batch.ts, events)

    def send(self, ts: float, events: list[Any]) -> None:
        self._sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), encode(ts, events, self.fmt)))
        self.seq += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
