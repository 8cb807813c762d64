"""FastDeploy's newer cache manager (`ENABLE_V1_KVCACHE_MANAGER=1`) on kvpool's Mooncake drop-in.

Its storage goes through `fastdeploy/cache_manager/v1/storage`: a factory that accepts only
`mooncake`, a `MooncakeStorageScheduler` (scheduler process: existence and prefix queries) and a
`MooncakeStorageConnector` (worker process: zero-copy batches from registered host memory), all on
`mooncake.store.MooncakeDistributedStore`. Those three files run here verbatim (data/fastdeploy_src),
with `mooncake.store` resolving to kvpool's drop-in as `PYTHONPATH=$(kvpool mooncake-shim)` makes it
resolve; only what needs paddle is replaced: `fastdeploy.utils` (host IP, logger), paddleformers'
logger and the `metadata` module's StorageType enum.
"""
from __future__ import annotations

import enum
import importlib
import logging
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvpool.core.client import PoolClient

from bkhelp import FASTDEPLOY_SRC, HostBuffer, fastdeploy_keys, payload

BLOCK = 64 << 10


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


class _StorageType(enum.Enum):
    MOONCAKE = "mooncake"


@pytest.fixture
def storage(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """FastDeploy's `fastdeploy.cache_manager.v1.storage`, imported from the verbatim files."""
    from kvpool.backends.mooncake_shim import mooncake
    from kvpool.backends.mooncake_shim.mooncake import store

    log = logging.getLogger("fastdeploy.test")
    package = _module("fastdeploy", __path__=[str(FASTDEPLOY_SRC)])
    for name, module in {
        "fastdeploy": package,
        "fastdeploy.utils": _module("fastdeploy.utils", get_host_ip=lambda: "127.0.0.1",
                                    get_logger=lambda name, file=None: logging.getLogger(f"fastdeploy.{name}")),
        "fastdeploy.cache_manager.v1.metadata": _module("fastdeploy.cache_manager.v1.metadata",
                                                        StorageType=_StorageType),
        "paddleformers": _module("paddleformers", __path__=[]),
        "paddleformers.utils": _module("paddleformers.utils", __path__=[]),
        "paddleformers.utils.log": _module("paddleformers.utils.log", logger=log),
        "mooncake": mooncake,
        "mooncake.store": store,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # the connector sets it if unset: restored after
    for var in ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER_SERVER_ADDR", "MOONCAKE_METADATA_SERVER"):
        monkeypatch.delenv(var, raising=False)
    before = set(sys.modules)
    yield importlib.import_module("fastdeploy.cache_manager.v1.storage")
    for name in set(sys.modules) - before:
        if name.startswith("fastdeploy"):
            del sys.modules[name]


def cache_config(master: str, backend: str | None = "mooncake") -> Any:
    """The two CacheConfig fields the factories read (`--kvcache-storage-backend`, its JSON config)."""
    return SimpleNamespace(kvcache_storage_backend=backend,
                           kvcache_storage_config={"master_server_addr": master, "metadata_server": "P2PHANDSHAKE",
                                                   "protocol": "tcp"})


class Host:
    """The connector's view of FastDeploy's pinned CPU cache: one registered region, blocks by pointer."""

    def __init__(self, blocks: int) -> None:
        self.buf = HostBuffer(blocks * BLOCK)

    def ptrs(self, first: int, n: int) -> list[int]:
        return [self.buf.ptr + (first + i) * BLOCK for i in range(n)]


def manager(storage: Any, master: str, tp_rank: int, blocks: int) -> tuple[Any, Any, Host]:
    """FastDeploy's storage scheduler and a connected connector of rank `tp_rank` at `master`, with a
    registered host cache of `blocks` blocks, as the v1 cache manager sets them up."""
    cfg = cache_config(master)
    scheduler = storage.create_storage_scheduler(cfg)  # connects (with its warm-up round trip) or raises
    connector = storage.create_storage_connector(cfg, tp_rank=tp_rank)
    assert connector.connect() and scheduler.is_connected()
    host = Host(blocks)
    connector.register_buffer(host.buf.ptr, host.buf.nbytes)
    return scheduler, connector, host


def test_the_v1_manager_stores_and_finds_blocks_through_the_drop_in(storage: Any, spawn: Any) -> None:
    worker = spawn()
    scheduler, connector, host = manager(storage, worker.unix_path, 0, 16)
    k, v, ks, vs = fastdeploy_keys([f"{i:064x}" for i in range(3)], scales=True)
    keys = k + v + ks + vs
    for i, key in enumerate(keys):
        host.buf.at(i * BLOCK, BLOCK)[:] = payload(key, BLOCK)
    assert scheduler.query_prefix_count(k, v, ks, vs) == 0
    assert connector.batch_set(keys, host.ptrs(0, 12), [BLOCK] * 12) == [True] * 12
    assert scheduler.batch_exists(keys) == [True] * 12 and scheduler.exists(k[0])
    assert scheduler.query_prefix_count(k, v) == 3 and scheduler.query_prefix_count(k, v, ks, vs) == 3
    dst = Host(12)
    connector.register_buffer(dst.buf.ptr, dst.buf.nbytes)
    assert connector.batch_get(keys, dst.ptrs(0, 12), [BLOCK] * 12) == [True] * 12
    assert np.array_equal(dst.buf.array, host.buf.array[:12 * BLOCK])
    assert connector.batch_set(keys[:2], host.ptrs(0, 2), [BLOCK] * 2) == [True, True]  # present: skipped
    with PoolClient(mode="local", worker=worker.unix_path) as pool:  # the blocks are in the kvpool worker
        assert pool.batch_exists(keys) == [True] * 12
    connector.disconnect()
    scheduler.disconnect()


def test_a_missing_block_ends_the_prefix(storage: Any, spawn: Any) -> None:
    worker = spawn()
    scheduler, connector, host = manager(storage, worker.unix_path, 1, 8)
    k, v = fastdeploy_keys([f"{i:064x}" for i in range(4)], rank=1)
    assert connector.batch_set(k + v, host.ptrs(0, 8), [BLOCK] * 8) == [True] * 8
    assert connector.delete(v[2])
    assert scheduler.query_prefix_count(k, v) == 2
    assert connector.batch_get(k + v, host.ptrs(0, 8), [BLOCK] * 8) == [True] * 6 + [False, True]
    assert connector.get(k[0], host.ptrs(0, 1)[0], BLOCK) and not connector.get(v[2], host.ptrs(0, 1)[0], BLOCK)
    assert connector.set(v[2], host.ptrs(6, 1)[0], BLOCK) and scheduler.query_prefix_count(k, v) == 4
    assert connector.clear() >= 8  # Mooncake's remove_all: the whole store (the v1 connector names no tenant)
    assert scheduler.query_prefix_count(k, v) == 0


def test_only_mooncake_is_accepted_and_none_means_no_storage(storage: Any, spawn: Any) -> None:
    worker = spawn()
    for backend in ("file", "kvpool"):
        with pytest.raises(ValueError, match="Supported types: mooncake"):
            storage.create_storage_connector(cache_config(worker.unix_path, backend))
        with pytest.raises(ValueError, match="Supported types: mooncake"):
            storage.create_storage_scheduler(cache_config(worker.unix_path, backend))
    assert storage.create_storage_connector(cache_config(worker.unix_path, None)) is None


def test_an_unreachable_pool_fails_the_connect_and_a_lost_one_reads_as_misses(storage: Any, spawn: Any,
                                                                              tmp_path: Any) -> None:
    with pytest.raises(RuntimeError, match="Failed to connect"):
        storage.create_storage_scheduler(cache_config(str(tmp_path / "no-worker.sock")))
    worker = spawn()
    scheduler, connector, host = manager(storage, worker.unix_path, 0, 4)
    k, v = fastdeploy_keys([f"{i:064x}" for i in range(2)])
    assert connector.batch_set(k + v, host.ptrs(0, 4), [BLOCK] * 4) == [True] * 4
    worker.kill()
    assert connector.batch_get(k + v, host.ptrs(0, 4), [BLOCK] * 4) == [False] * 4
    assert connector.batch_set(k + v, host.ptrs(0, 4), [BLOCK] * 4) == [False] * 4
    assert scheduler.query_prefix_count(k, v) == 0 and scheduler.batch_exists(k) == [False, False]
