"""The blocks the kvtest-like suites write: bytes that are a function of the key, so any reader in any
process checks what it got without asking the writer; and the memcpy baseline of reading them."""
from __future__ import annotations

import numpy as np
import xxhash

from .measure import best_seconds, filled, gbps

__all__ = ["BlockContent", "memcpy_gbps"]


def _digest(key: str) -> bytes:
    return xxhash.xxh64_digest(key.encode())


class BlockContent:
    """Every block's content: a fixed pattern whose first 8 bytes are replaced by the key's hash. Key
    number n (the key's last `/` part) has size `sizes[n % len(sizes)]`."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.size = max(sizes)
        self.pattern = filled(self.size, 3)

    def size_of(self, key: str) -> int:
        return self.sizes[int(key.rpartition("/")[2]) % len(self.sizes)]

    def make(self, key: str) -> np.ndarray:
        block: np.ndarray = self.pattern[:self.size_of(key)].copy()
        block[:8] = np.frombuffer(_digest(key), dtype=np.uint8)
        return block

    def check(self, key: str, buf: np.ndarray, n: int) -> bool:
        return (n == self.size_of(key) and buf[:8].tobytes() == _digest(key)
                and np.array_equal(buf[8:n], self.pattern[8:n]))


def memcpy_gbps(block: int, blocks: int, repeat: int) -> float:
    """numpy copies of `blocks` distinct blocks into one buffer: what a hit could cost at best."""
    src, dst = filled(blocks * block, 4).reshape(blocks, block), np.empty(block, dtype=np.uint8)

    def copy_all() -> None:
        for row in src:
            np.copyto(dst, row)
    return gbps(blocks * block, best_seconds(copy_all, repeat))
