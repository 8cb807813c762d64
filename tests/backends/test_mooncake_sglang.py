"""SGLang's own Mooncake backend (its `mooncake_store.py`, unchanged) on kvpool's drop-in: every host
pool layout it supports (MLA layer_first goes through the multi-buffer calls), stored and read back
byte-exact through its v1 calls. (MHA layer_first is refused by SGLang's Mooncake backend itself.)"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.backends.mooncake_shim import shim_path

from sglang_pools import MHA_LAYOUTS, MLA_LAYOUTS, PAGE, StorageBackendFactory, config, host_pool, page_bytes


@pytest.fixture
def mooncake_on_kvpool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`from mooncake.store import ...` resolves to the drop-in, as `PYTHONPATH=$(kvpool mooncake-shim)` does."""
    monkeypatch.syspath_prepend(shim_path())
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("KVPOOL_DRAM_SLAB_SIZE", "1MiB")
    monkeypatch.setenv("KVPOOL_PREFAULT", "false")
    yield


def _sglang_mooncake(host: Any, mla: bool) -> Any:
    extra = {"master_server_address": "embedded", "global_segment_size": 32 << 20, "protocol": "tcp"}
    backend = StorageBackendFactory.create_backend("mooncake", config(mla=mla, extra_config=extra), host)
    backend.register_mem_pool_host(host)
    return backend


@pytest.mark.parametrize("mla,layout", [(False, lay) for lay in MHA_LAYOUTS if lay != "layer_first"]
                         + [(True, lay) for lay in MLA_LAYOUTS])
def test_sglang_mooncake_backend_round_trip(mooncake_on_kvpool: None, mla: bool, layout: str) -> None:
    host = host_pool(layout, mla=mla)
    backend = _sglang_mooncake(host, mla)
    try:
        assert type(backend.store).__module__ == "kvpool.backends.mooncake_compat"
        keys = [f"{i:064x}" for i in range(1, 6)]
        src = host.alloc(5 * PAGE)
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, src) == [True] * 5
        assert backend.batch_exists(keys) == 5
        dst = host.alloc(5 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 5
        for i in range(5):
            assert page_bytes(host, int(dst[i * PAGE])) == page_bytes(host, int(src[i * PAGE])), f"page {i}"
        other = host.alloc(PAGE)  # a page never stored is a miss, and leaves its slots as they were
        before = page_bytes(host, int(other[0]))
        assert backend.batch_get_v1([f"{99:064x}"], other) == [False]
        assert page_bytes(host, int(other[0])) == before
    finally:
        backend.store.close()
