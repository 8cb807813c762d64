"""The device tier: copies of the hottest blocks as torch uint8 tensors (GPU HBM when present).

It is an inclusive cache above DRAM/SSD: every block here also lives in a lower tier, so eviction
simply drops the copy. On a CPU-only machine the cache builds no device tier; tests drive this class
with CPU tensors. It holds no lock of its own: the cache calls it with its lock held.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError
from ..policies import EVICTION_POLICY

__all__ = ["DeviceTier", "cuda_available"]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class DeviceTier:
    """Blocks as flat uint8 tensors on `device` ("cuda", "cuda:1", or "cpu" in tests), at most
    `capacity` bytes of them, evicted in the order `policy` (a key of `EVICTION_POLICY`) says."""

    def __init__(self, device: str = "cuda", capacity: int = 1 << 30, policy: str = "lru") -> None:
        try:
            import torch
        except ImportError as e:
            raise ConfigError(f"device={device!r}: the device tier needs torch (pip install torch)") from e
        self._torch = torch
        dev = torch.device(device)
        if dev.type == "cuda" and not (cuda_available() and (dev.index or 0) < torch.cuda.device_count()):
            raise ConfigError(f"device={device!r}: no such CUDA device here (device='auto' uses one where present)")
        if dev.type == "cuda" and dev.index is None:
            # tensors report an explicit index, and torch.device("cuda") != torch.device("cuda", 0)
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.capacity = capacity
        self.blocks: dict[bytes, Any] = {}
        self._order = EVICTION_POLICY[policy]()
        self.nbytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.blocks)

    def holds_tensor(self, t: Any) -> bool:
        """Whether `t` is a torch tensor on this tier's device (a put of it keeps a device copy)."""
        module: str = type(t).__module__
        return module.startswith("torch") and bool(t.device == self.device)

    def fits(self, t: Any) -> bool:
        nbytes: int = t.numel() * t.element_size()
        return nbytes <= self.capacity

    def put(self, key: bytes, t: Any) -> int:
        """Keep a copy of tensor `t`'s bytes (replacing any copy of `key`), evicting the first copies
        to go until it fits; returns how many were evicted. The caller checks `fits(t)` first."""
        self.drop(key)
        n = t.numel() * t.element_size()
        evicted = 0
        while self.nbytes + n > self.capacity:
            self.drop(next(iter(self._order)))
            evicted += 1
        flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(self._torch.uint8)
        self.blocks[key] = flat.to(self.device, copy=True)
        self._order.add(key)
        self.nbytes += n
        return evicted

    def get(self, key: bytes) -> Any | None:
        """The copy of `key` (a flat uint8 tensor on the device), or None."""
        return self.blocks.get(key)

    def touch(self, key: bytes) -> None:
        """`key`'s copy was used: it goes later."""
        self._order.touch(key)

    def drop(self, key: bytes) -> None:
        t = self.blocks.pop(key, None)
        if t is not None:
            self.nbytes -= t.numel()
            self._order.discard(key)

    def clear(self) -> None:
        self.blocks.clear()
        self._order.clear()
        self.nbytes = 0

    def check(self) -> list[str]:
        """What is wrong with this tier (empty when consistent): the order and byte count agree with
        the copies held, within capacity."""
        held = sum(t.numel() for t in self.blocks.values())
        if set(self._order) != self.blocks.keys() or held != self.nbytes or held > self.capacity:
            return [f"device tier counts {self.nbytes} bytes and orders {len(self._order)} keys; it holds "
                    f"{len(self.blocks)} copies of {held} bytes (capacity {self.capacity})"]
        return []
