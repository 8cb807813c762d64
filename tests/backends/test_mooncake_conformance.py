"""Conformance of kvpool's Mooncake drop-in (`backends/mooncake_compat.py`) with the real Mooncake store API.

Each test drives the drop-in as a Mooncake caller does and asserts what Mooncake itself returns or does,
as read in the public Mooncake sources (kvcache-ai/Mooncake at 3b5a594, cited per test) and in the
engine code that relies on it. Only places where a caller would see a different result are checked:
deliberate, documented differences (a put replaces, no leases, existence is 0 when the pool cannot
answer; the default tenant's `remove_all` empties the whole pool, tenants' objects too) are left alone.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.backends.mooncake_compat import MooncakeDistributedStore

from bkhelp import MiB, payload


def _embedded(store: MooncakeDistributedStore) -> MooncakeDistributedStore:
    # SGLang / FastDeploy / LMCache's positional form (seven arguments)
    assert store.setup("localhost", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", "embedded") == 0
    return store


def test_batch_get_buffer_serves_lmcache_default_reads(store: MooncakeDistributedStore, small_env: None) -> None:
    """LMCache's Mooncake connector, in its default mode (`save_chunk_meta` defaults to True:
    LMCache/LMCache lmcache/v1/storage_backend/connector/base_connector.py, `save_chunk_meta: bool = True`
    and `extra_config.get("save_chunk_meta", True)`), writes each chunk with
    `store.put_parts(key, metadata_bytes, kv_bytes)` and reads it back only through
    `store.batch_get_buffer(key_strs)` (mooncakestore_connector.py `_put_with_metadata` /
    `_batch_get_buffer`), then `memoryview(buffer)` and `len(...) == metadata.length + 28`.

    Mooncake: `batch_get_buffer` is bound in mooncake-integration/store/store_py.cpp (`.def("batch_get_buffer",
    ...)`, ~line 2333) and returns one `BufferHandle` per key (a buffer-protocol object, store_py.cpp ~2035-2045:
    `py::buffer_protocol()`, `size`, `__len__`, `def_buffer`), None for a key not found
    (mooncake-store/src/real_client.cpp `batch_get_buffer_internal`, ~3147: results start as nullptr and a
    missing key is skipped; docs/source/api-reference/python/mooncake-store.md "batch_get_buffer()":
    "List of buffer objects, with None for keys not found").

    kvpool: the drop-in has no `batch_get_buffer`: LMCache's call raises AttributeError,
    which the connector catches and turns into `[None] * len(keys)`, so every chunk it stored is a miss
    while `is_exist` says it is there.
    """
    _embedded(store)
    meta = payload("meta", 28).tobytes()  # LMCache's METADATA_BYTES_LEN
    kv = payload("kv", 4096).tobytes()
    assert store.put_parts("lmcache@chunk0", meta, kv) == 0
    assert store.is_exist("lmcache@chunk0") == 1

    buffers = store.batch_get_buffer(["lmcache@chunk0", "lmcache@absent"])  # type: ignore[attr-defined]

    assert len(buffers) == 2
    assert buffers[1] is None
    view = memoryview(buffers[0])
    assert len(view) == len(meta) + len(kv)
    assert bytes(view) == meta + kv


def test_keys_longer_than_511_bytes_are_stored(store: MooncakeDistributedStore, small_env: None) -> None:
    """Mooncake puts no length limit on an object key: the master refuses only an empty key (or a zero
    length / zero replicas) — mooncake-store/src/master_service.cpp `MasterService::PutStart` (~line 4284-4297:
    `key.empty() || slice_length == 0` -> INVALID_PARAMS); nothing in the client (real_client.cpp `put_internal`
    ~1947, `batch_put_from_internal` ~4141) checks the length. A 600-byte key is stored (0), exists (1) and
    reads back.

    Engines build keys from user-controlled parts: vLLM's Mooncake store connector
    (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/data.py `PoolKey.build_prefix`:
    `{cache_prefix}@{model_name}{store_namespace}@tp_rank:..@pcp..@dcp..@pp_rank:..@group:..@{chunk_hash}`,
    model_name being the model path), LMCache's `CacheEngineKey.to_string()` likewise.

    kvpool: keys are limited to 511 bytes (less under a tenant, whose `tenant/<id>/` prefix counts): the put
    returns INVALID_PARAMS (-600) and the key is never present, so an engine with such keys caches nothing
    (one warning, then silence).
    """
    _embedded(store)
    model = "/mnt/shared-models/" + "org/" * 100 + "Llama-3.1-70B-Instruct"
    key = f"team-a@{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{'ab' * 32}"
    assert len(key.encode()) > 511

    assert store.put(key, b"block") == 0
    assert store.is_exist(key) == 1
    assert store.get(key) == b"block"


def _tenants(spawn: Callable[..., Any]) -> tuple[MooncakeDistributedStore, MooncakeDistributedStore]:
    worker = spawn()
    default, tenant = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert default.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.unix_path) == 0
    assert tenant.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.unix_path, tenant_id="b") == 0
    return default, tenant


def test_remove_all_returns_the_number_of_objects_it_removed(spawn: Callable[..., Any]) -> None:
    """Mooncake's `remove_all` returns how many objects it removed: master_service.cpp
    `MasterService::RemoveAll(const TenantId&, bool)` (~6666) counts `removed_count++` per erased object of
    the tenant and returns it (also the unscoped overload, ~6581); docs/source/api-reference/python/
    mooncake-store.md "remove_all()": "Number of objects removed". FastDeploy's connector hands it on as
    such (cache_manager/v1/storage/mooncake/connector.py `clear()`: "Number of objects removed (as reported
    by the store)"; base.py `clear()`: "Number of keys cleared").

    kvpool: it returns the number of blocks the whole pool held before the call, every tenant's (and a block
    in two tiers twice): tenant b, holding one object in a pool of three, is told it removed three.
    """
    default, tenant = _tenants(spawn)
    try:
        assert default.put("d1", b"1") == 0 and default.put("d2", b"2") == 0
        assert tenant.put("b1", b"3") == 0

        removed = tenant.remove_all()

        assert tenant.is_exist("b1") == 0
        assert removed == 1
    finally:
        default.close()
        tenant.close()


def test_get_buffer_returns_a_buffer_protocol_handle(store: MooncakeDistributedStore, small_env: None) -> None:
    """`get_buffer(key)` (store_py.cpp `.def("get_buffer", ...)`, ~2326; real_client.cpp `get_buffer_internal`
    ~2815) returns a BufferHandle usable as `np.array(buffer, copy=False)` with `size()` / `len()`
    (docs "get_buffer Buffer Protocol"); vllm-ascend's and LMCache's Mooncake paths read objects that way.
    kvpool: no `get_buffer` at all (AttributeError)."""
    _embedded(store)
    data = payload("gb", 1000)
    assert store.put("gb", data.tobytes()) == 0

    handle = store.get_buffer("gb")  # type: ignore[attr-defined]

    assert handle is not None and handle.size() == len(handle) == 1000
    assert np.array_equal(np.frombuffer(handle, dtype=np.uint8), data)


def test_register_refuses_memory_the_process_cannot_touch() -> None:
    # An engine written against Mooncake registers its GPU KV allocations (Mooncake moves them by RDMA).
    # Taken as host memory, the first copy killed the engine with SIGSEGV: in a child process here, so
    # that such a crash fails the test rather than the run. GPU memory lies, for the CPU, in ranges
    # mapped with no access, as a PROT_NONE mapping does; a read-only one and an unmapped one alike.
    code = textwrap.dedent("""
        import mmap, numpy as np
        from kvpool.backends.mooncake_compat import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", "embedded") == 0
        none = mmap.mmap(-1, 1 << 16, prot=0)  # PROT_NONE
        ro = mmap.mmap(-1, 1 << 16, prot=mmap.PROT_READ)
        ok = np.zeros(1 << 16, np.uint8)
        ptr = lambda m: np.frombuffer(m, np.uint8).ctypes.data
        codes = [s.register_buffer(ptr(none), 4096), s.register_buffer(ptr(ro), 4096), s.register_buffer(8, 4096),
                 s.register_buffer(ok.ctypes.data, ok.nbytes + (1 << 40)), s.register_buffer(ok.ctypes.data, ok.nbytes)]
        print(codes, s.put("k", b"v" * 100), s.batch_get_into(["k"], [ptr(none)], [4096]), flush=True)
        s.close()
    """)
    env = {**os.environ, "KVPOOL_DRAM_SLAB_SIZE": "2MiB", "KVPOOL_PREFAULT": "false"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["[-600,", "-600,", "-600,", "-600,", "0]", "0", "[-600]"]
