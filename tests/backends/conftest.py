"""Fixtures of the Mooncake drop-in's tests (test_mooncake_compat.py, test_mooncake_conformance.py)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.backends.mooncake_compat import MooncakeDistributedStore


@pytest.fixture
def small_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick embedded pool: its size comes from setup()'s global_segment_size, in 2 MiB slabs."""
    monkeypatch.setenv("KVPOOL_DRAM_SLAB_SIZE", "2MiB")
    monkeypatch.setenv("KVPOOL_PREFAULT", "false")


@pytest.fixture
def store() -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    yield s
    s.close()
