"""The in-process worker of the same-node protocol tests (a module with a `worker` of its own uses that),
and a three-node NATS cluster for those about joining and failing over."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nats_nodes import ThreeNodes

from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    """A worker in this process: 96 MiB of DRAM in 4 MiB slabs, on a Unix socket and a TCP port."""
    w = Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock")),
               CacheConfig(dram_bytes=96 << 20, dram_slab_size=4 << 20, prefault=False)).start()  # type: ignore[arg-type]
    yield w
    w.stop()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[ThreeNodes]:
    """Three NATS nodes (started by the test, `nodes.start(i)`), stopped after it."""
    n = ThreeNodes(tmp_path)
    yield n
    n.stop()
