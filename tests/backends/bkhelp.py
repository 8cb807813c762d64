"""Helpers shared by the backend tests: host buffers handed over by raw address, as FastDeploy and
Mooncake users hand their pinned staging buffers, and deterministic block contents."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
KiB = 1 << 10

SMALL_POOL: dict[str, Any] = dict(dram_bytes=32 * MiB, dram_slab_size=1 * MiB, prefault=False)
"""An embedded pool that is quick to create (PoolClient / KVPoolStore keyword options)."""
SMALL_ENV = {"KVPOOL_DRAM_BYTES": "32MiB", "KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "false"}
"""The same, as KVPOOL_* variables, for code that builds its pool from the environment."""

DATA = Path(__file__).parent / "data"
FASTDEPLOY_SRC = DATA / "fastdeploy_src" / "fastdeploy"
"""Verbatim copies of the FastDeploy files the patcher edits."""


def payload(key: str, size: int) -> np.ndarray:
    """Deterministic, non-periodic bytes for (`key`, `size`)."""
    seed = int.from_bytes(hashlib.sha256(f"{key}/{size}".encode()).digest()[:8], "little")
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


class HostBuffer:
    """One host allocation addressed by raw pointer (numpy via ctypes, or a torch CPU tensor via
    data_ptr()), like FastDeploy's `cuda_host_alloc` buffers."""

    def __init__(self, nbytes: int, kind: str = "numpy") -> None:
        if kind == "torch":
            import torch

            self.tensor = torch.zeros(nbytes, dtype=torch.uint8)
            self.ptr = int(self.tensor.data_ptr())
            self.array = self.tensor.numpy()
        else:
            self.array = np.zeros(nbytes, dtype=np.uint8)
            self.ptr = int(self.array.ctypes.data)
        self.nbytes = nbytes

    def at(self, offset: int, size: int) -> np.ndarray:
        return self.array[offset:offset + size]


def fastdeploy_keys(hashes: list[str], rank: int = 0, prefix: str = "", scales: bool = False) -> list[list[str]]:
    """[k_keys, v_keys] (+ [k_scale_keys, v_scale_keys]) exactly as FastDeploy's transfer manager builds them."""
    suffixes = ["key", "value"] + (["key_scale", "value_scale"] if scales else [])
    return [[f"prefix{prefix}_{h}_{rank}_{s}" for h in hashes] for s in suffixes]


