"""The pool's block events in vLLM's KV-event format, published on a ZMQ PUB socket.

Cache-aware routers (vLLM's own subscriber example, NVIDIA Dynamo's KV router, llm-d's indexer)
read engines' events as ZMQ multipart messages `(topic, seq: 8-byte big-endian, payload)`, the
payload a msgpack array `[ts, [event, ...], dp_rank]`, each event a `BlockStored`, `BlockRemoved` or
`AllBlocksCleared`. kvpool's block events map onto them so a router can route on what the whole pool
holds: a block hash entering the pool (its first holder, any worker) is a `BlockStored` with the tier
as `medium` (DRAM "CPU", SSD "STORAGE"), its last holder letting go of it (removed, evicted out of its
last tier, expired, corrupt, a worker's `cleared` or restart) a `BlockRemoved`; a `cleared` where no
other worker holds anything is an `AllBlocksCleared`. `BlockHolders` keeps those holders across
batches and workers: a router sees only what it was told, never a removal of a block it was not told
of, nor one another worker still holds. Moves between tiers are not events for a router that ignores
`medium` (the block is still in the pool); `tier_moves=True` adds them, as a `BlockStored` in the new
tier and a `BlockRemoved` in the old one, for routers that track media.

The block hash is the one the pool key names: its last 64-hex-digit run as 32 bytes (SGLang page
hashes, which are SGLang's own; kvpool's vLLM connector keys `vllm/<sha256>`, which are kvpool's own
chain hash of the tokens, `kvpool.core.keys.block_keys`, not vLLM's `hash_block_tokens`: a router
must index these hashes, not the ones vLLM's engines publish), else the SHA-256 of the whole key; with
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

__all__ = ["MEDIUM", "LAYOUTS", "HASHES", "VllmFormat", "block_hash", "BlockHolders", "vllm_events", "encode",
           "ZmqSink"]

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
    """The block hash a pool key names (see the module docstring: for kvpool's vLLM connector, kvpool's
    own chain hash, not vLLM's)."""
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


class _Out:
    """The vLLM events of one batch as they are made: consecutive removals from one medium merged."""

    def __init__(self, fmt: VllmFormat) -> None:
        self.fmt = fmt
        self.events: list[Any] = []
        self._removing: tuple[str, list[Any], set[Any]] | None = None  # the BlockRemoved being merged into
        # (its medium, its hashes, and them as a set: a batch removes thousands)

    def stored(self, h: Any, medium: str) -> None:
        self.events.append(_stored(self.fmt, [h], medium))
        self._removing = None

    def removed(self, h: Any, medium: str) -> None:
        if self._removing is not None and self._removing[0] == medium:
            if h not in self._removing[2]:
                self._removing[1].append(h)
                self._removing[2].add(h)
        else:
            self._removing = (medium, [h], {h})
            self.events.append(_removed(self.fmt, self._removing[1], medium))

    def cleared(self) -> None:
        self.events.append(_cleared(self.fmt))
        self._removing = None


class BlockHolders:
    """Which workers hold each block hash (in each medium with `tier_moves`, else anywhere in the
    pool), kept across batches and workers so that what a router is told stays true of the pool: a
    `BlockStored` when a hash gets its first holder, a `BlockRemoved` when its last goes. Feed it every
    batch in order (`events(batch)`); one instance per socket (`ZmqSink` has one)."""

    def __init__(self, fmt: VllmFormat) -> None:
        self.fmt = fmt
        self._tiers: dict[tuple[str, bytes], set[str]] = {}  # (worker, key) -> tiers holding it
        self._holders: dict[tuple[Any, str], set[str]] = {}  # (hash, medium or "" for the pool) -> workers
        self._boots: dict[str, str] = {}

    def _slot(self, h: Any, tier: str) -> tuple[Any, str]:
        return (h, _medium(tier) if self.fmt.tier_moves else "")

    def _hold(self, worker: str, h: Any, tier: str, out: _Out) -> None:
        workers = self._holders.setdefault(self._slot(h, tier), set())
        if not workers:
            out.stored(h, _medium(tier))
        workers.add(worker)

    def _release(self, worker: str, h: Any, tier: str, out: _Out) -> None:
        slot = self._slot(h, tier)
        workers = self._holders.get(slot)
        if workers is None or worker not in workers:
            return  # never announced as this worker's: nothing a router was told changes
        workers.discard(worker)
        if not workers:
            del self._holders[slot]
            out.removed(h, _medium(tier))

    def _clear(self, worker: str, out: _Out) -> None:
        """`worker` holds nothing now: where no other worker holds anything either, AllBlocksCleared;
        else a BlockRemoved for each hash only it held."""
        if all(ws <= {worker} for ws in self._holders.values()):
            self._holders.clear()
            self._tiers.clear()
            out.cleared()
            return
        mine = [wk for wk in self._tiers if wk[0] == worker]
        for wk in mine:
            h = block_hash(wk[1], self.fmt.block_hash)
            for tier in sorted(self._tiers.pop(wk)):
                self._release(worker, h, tier, out)

    def events(self, batch: EventBatch) -> list[Any]:
        """The vLLM events of one kvpool batch, in order: one BlockStored per block (the pool does not
        know which blocks chain), consecutive removals from one medium merged into one BlockRemoved."""
        out = _Out(self.fmt)
        w, moves = batch.worker, self.fmt.tier_moves
        if self._boots.setdefault(w, batch.boot) != batch.boot:  # restarted: what it held went with it
            self._boots[w] = batch.boot
            self._clear(w, out)
        for e in batch.events:
            if e.kind == "cleared":
                self._clear(w, out)
                continue
            wk = (w, e.key)
            h = block_hash(e.key, self.fmt.block_hash)
            before = self._tiers.get(wk, set())
            if e.kind == "stored":  # new bytes: copies of older ones in other tiers are gone
                after = {e.tier}
                for tier in sorted(before - after) if moves else ():
                    self._release(w, h, tier, out)
                self._hold(w, h, e.tier, out)
            elif e.kind == "copied":
                after = before | {e.tier}
                self._hold(w, h, e.tier, out)  # (pool level: a block it was not known to hold)
            elif e.kind == "dropped":
                after = before - {e.tier}
                if moves:
                    self._release(w, h, e.tier, out)
            elif e.kind == "removed":
                after = set()
                for tier in sorted(before | {e.tier}) if moves else (e.tier,):
                    self._release(w, h, tier, out)
            else:
                continue  # a kind this version does not know
            if after:
                self._tiers[wk] = after
            else:
                self._tiers.pop(wk, None)
        return out.events


def _medium(tier: str) -> str:
    return MEDIUM.get(tier, tier.upper())


def vllm_events(batch: EventBatch, fmt: VllmFormat, holders: BlockHolders | None = None) -> list[Any]:
    """The vLLM events of one kvpool batch (`BlockHolders.events`), after the batches `holders` saw
    (none: this batch alone)."""
    return (holders or BlockHolders(fmt)).events(batch)


def encode(ts: float, events: list[Any], fmt: VllmFormat) -> bytes:
    """msgpack of vLLM's `KVEventBatch`: `[ts, events, dp_rank]`."""
    import msgspec

    return msgspec.msgpack.encode([ts, events, fmt.dp_rank])


class ZmqSink:
    """Binds a ZMQ PUB socket at `endpoint` (e.g. `tcp://127.0.0.1:5557`, `tcp://*:5557`) and sends
    each batch's vLLM events as `(topic, seq, payload)`, `seq` counting messages from 0 as vLLM's
    publisher does. Its `BlockHolders` spans every batch it is given, from any number of
    workers. Needs `pip install -e '.[events]'` (pyzmq, msgspec)."""

    def __init__(self, endpoint: str, fmt: VllmFormat | None = None, topic: str = "", hwm: int = 100_000) -> None:
        try:
            import msgspec  # noqa: F401
            import zmq
        except ImportError as e:
            raise ConfigError(f"ZMQ events need pyzmq and msgspec: pip install -e '.[events]' ({e})") from e
        self.fmt = fmt or VllmFormat()
        self.holders = BlockHolders(self.fmt)
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
        events = self.holders.events(batch)
        if events:
            self.send(batch.ts, events)

    def send(self, ts: float, events: list[Any]) -> None:
        self._sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), encode(ts, events, self.fmt)))
        self.seq += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
