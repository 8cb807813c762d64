"""The device tier: copies of the hottest blocks as torch uint8 tensors (GPU HBM when present).

It is an inclusive cache above DRAM/SSD: every block here also lives in a lower tier, so eviction
simply drops the copy. On a CPU-only machine the cache builds no device tier; tests drive this class
with CPU tensors.
"""
from __future__ import annotations

from typing import Any


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class DeviceTier:
    """Blocks as flat uint8 tensors on `device` ("cuda", "cuda:1", or "cpu" in tests)."""

    def __init__(self, device: str = "cuda") -> None:
        import torch

        self._torch = torch
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            # tensors report an explicit index, and torch.device("cuda") != torch.device("cuda", 0)
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.blocks: dict[bytes, Any] = {}

    def put(self, key: bytes, t: Any) -> None:
        """Keep a copy of tensor `t`'s bytes on the device."""
        flat = t.detach().contiguous().reshape(-1).view(self._torch.uint8)
        self.blocks[key] = flat.to(self.device, copy=True)

    def get(self, key: bytes) -> Any | None:
        return self.blocks.get(key)

    def drop(self, key: bytes) -> None:
        self.blocks.pop(key, None)

    def clear(self) -> None:
        self.blocks.clear()
