"""Eviction orders, as a small table keyed by name (`EVICTION_POLICY["lru"]`).

An order tracks keys of one tier; iterating yields eviction candidates, first to go first. It is a plain
dict (insertion-ordered; a key moved to the back is popped and reinserted): half the memory of an
OrderedDict per key and twice as fast to build for a tier of a million blocks reopened from disk.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["LruOrder", "FifoOrder", "EVICTION_POLICY"]


class LruOrder:
    """Least recently used first: an access moves a key to the back."""

    def __init__(self) -> None:
        self._keys: dict[bytes, Any] = {}  # (values unused: None, or an adopted index's)

    @property
    def table(self) -> dict[bytes, Any]:
        """The keys in order, as a dict (first to go first; values unused): the DRAM tier's bulk insert
        (`_native.index_many`) pops a key from it and sets it at the back, as `discard` then `extend` do."""
        return self._keys

    def add(self, key: bytes) -> None:
        keys = self._keys
        keys.pop(key, None)
        keys[key] = None

    def extend(self, keys: Iterable[bytes]) -> None:
        """`add` of each key not tracked yet, in order (a tier rebuilt at open)."""
        if self._keys:
            self._keys.update(dict.fromkeys(keys))
        else:
            self._keys = dict.fromkeys(keys)

    def adopt(self, keys: dict[bytes, Any]) -> None:
        """Track the keys of `keys` (a tier's index reopened), in its order, in place of any tracked now:
        a copy of the dict, its table copied whole (a million keys: ~0.04 s, against ~0.11 s to insert
        them one by one); its values are never read."""
        self._keys = keys.copy()

    def touch(self, key: bytes) -> None:
        keys = self._keys
        if key in keys:
            del keys[key]
            keys[key] = None

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def discard_many(self, keys: Iterable[bytes]) -> None:
        pop = self._keys.pop
        for k in keys:
            pop(k, None)

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
