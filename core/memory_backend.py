"""`MemoryBackend`: a PoolBackend over a dict of bytes, for tests of the layers above PoolClient.

`PoolClient(backend=MemoryBackend())` behaves as a pool that never evicts: what was put is there
until removed or cleared. Pins are accepted and kept (with nothing to evict they protect nothing).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .buffers import destinations, finish_all, readable_all
from .errors import BlockTooLarge, BufferSizeError, PoolClosed
from .pool_backend import MembersPredicate
from .records import PoolStats, WorkerInfo
from .stats import CacheStats

__all__ = ["MemoryBackend"]


class MemoryBackend:
    """Blocks in a dict, under one lock; `max_block` bounds a block as a DRAM tier's slab would."""

    def __init__(self, max_block: int = 16 << 20) -> None:
        self._max_block = max_block
        self._blocks: dict[bytes, bytes] = {}
        self._pins: dict[bytes, float] = {}  # key -> monotonic deadline
        self._counts = {"puts": 0, "hits_dram": 0, "misses": 0}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def max_block(self) -> int:
        return self._max_block

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosed("the memory backend is closed")

    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float = 0.0) -> None:
        views = readable_all(buffers)
        for k, v in zip(keys, views):
            if v.nbytes > self._max_block:
                raise BlockTooLarge(f"block {k[:24]!r} is {v.nbytes} bytes; the max block is {self._max_block}",
                                    key=k, size=v.nbytes, limit=self._max_block)
        with self._lock:
            self._check_open()
            self._blocks.update((k, v.tobytes()) for k, v in zip(keys, views))
            self._counts["puts"] += len(keys)
        if pin_s > 0:
            self.batch_pin(keys, pin_s)

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        dests = destinations(buffers)
        found = self._lookup(keys)
        out: list[int] = []
        for k, data, dest in zip(keys, found, dests):
            if data is not None and len(data) > dest.nbytes:
                raise BufferSizeError(f"block {k[:24]!r} is {len(data)} bytes; the destination holds {dest.nbytes}",
                                      key=k, size=len(data), limit=dest.nbytes)
            if data is not None:
                dest.view[:len(data)] = data
            out.append(-1 if data is None else len(data))
        finish_all(dests, out)
        return out

    def _lookup(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's block (None: a miss), counted as a read."""
        with self._lock:
            self._check_open()
            found = [self._blocks.get(k) for k in keys]
            hits = sum(b is not None for b in found)
            self._counts["hits_dram"] += hits
            self._counts["misses"] += len(keys) - hits
        return found

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [k in self._blocks for k in keys]

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        flags = self.batch_exists(keys)
        return next((i for i, f in enumerate(flags) if not f), len(flags))

    def batch_remove(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [self._blocks.pop(k, None) is not None for k in keys]

    def batch_pin(self, keys: Sequence[bytes], pin_s: float) -> None:
        until = time.monotonic() + pin_s
        with self._lock:
            self._check_open()
            for k in keys:
                if pin_s > 0:
                    self._pins[k] = until
                else:
                    self._pins.pop(k, None)

    @contextmanager
    def batch_lease(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        yield [None if b is None else memoryview(b) for b in self._lookup(keys)]

    def clear(self, prefix: bytes | None = None) -> None:
        with self._lock:
            self._check_open()
            doomed = [k for k in self._blocks if prefix is None or k.startswith(prefix)]
            for k in doomed:
                del self._blocks[k]

    def stats(self) -> PoolStats:
        with self._lock:
            now = time.monotonic()
            fill = {"dram_blocks": len(self._blocks), "dram_bytes": sum(map(len, self._blocks.values()))}
            pins = sum(until > now for until in self._pins.values())
            return PoolStats(CacheStats.from_dict({**self._counts, **fill, "pins": pins}))

    def members(self) -> dict[str, WorkerInfo]:
        return {}

    def wait_for_members(self, predicate: MembersPredicate, timeout_s: float) -> bool:
        return predicate({})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._blocks.clear()
