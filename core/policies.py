"""Eviction orders, as a small table keyed by name (`EVICTION_POLICY["lru"]`).

An order tracks keys of one tier; iterating yields eviction candidates, first to go first.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class LruOrder:
    """Least recently used first: an access moves a key to the back."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._keys)  # callers collect victims before evicting

    def __len__(self) -> int:
        return len(self._keys)


class FifoOrder(LruOrder):
    """Oldest insertion first: accesses do not reorder."""

    def touch(self, key: bytes) -> None:
        pass


EVICTION_POLICY: dict[str, type[LruOrder]] = {"lru": LruOrder, "fifo": FifoOrder}
