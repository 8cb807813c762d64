"""Helpers shared by the core tests (a plain module, so tests and child scripts can import it)."""
from __future__ import annotations

import hashlib

import numpy as np

MiB = 1 << 20
KiB = 1 << 10

SMALL = dict(dram_bytes=32 * MiB, dram_slab_size=1 * MiB, prefault=False)
"""A small arena that is quick to create; tests that need other sizes override these."""


def payload(key: str | bytes, size: int) -> bytes:
    """Deterministic, non-periodic bytes for (`key`, `size`): a reader can check a block without
    remembering what was put, and a copy at a wrong offset does not match."""
    k = key.encode() if isinstance(key, str) else bytes(key)
    seed = int.from_bytes(hashlib.sha256(k + size.to_bytes(8, "little")).digest()[:8], "little")
    return np.random.default_rng(seed).bytes(size)
