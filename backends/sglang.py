"""kvpool as SGLang's HiCache L3 storage, loaded by SGLang's dynamic storage backend.

`--hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
"module_path": "kvpool.backends.sglang", "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, ...}'`
(examples/sglang/). With `"interface_v1": 1` SGLang's cache controller hands over host-pool slot
indices and the pages move by pointer between its host KV pool and the pool, one copy each way;
without it, it hands over flat page tensors (the "tensor form"). Either way pool failures become
misses and failed writes, logged once, so the scheduler never sees an exception from the pool.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvpool.core.client import PoolClient

from ._hostio import HostIO, Status

log = logging.getLogger("kvpool.backends.sglang")

__all__ = ["KVPoolHiCacheStorage", "KVPoolStorageMetrics", "pool_options"]

_ENGINE_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "file_storage_path"})
"""extra_config keys that are SGLang's, not kvpool's: the factory's three, the v1 switch, and the
`--file-storage-path` default SGLang adds to every storage backend's extra config."""

_ADAPTER_KEYS = frozenset({"retry_s"})

_PAGE = [".page"]
"""The one part of a page in the tensor form (a flat page tensor is one object)."""


def pool_options(extra_config: dict[str, Any] | None) -> dict[str, Any]:
    """The `PoolClient` options in SGLang's extra config: every key that is neither SGLang's nor the
    adapter's (`mode`, `worker`, `nats_url`, `token`, `replication`, `timeout_s`, and in embedded mode
    `dram_bytes`, `ssd_path`, ...). `KVPOOL_*` variables fill in the rest; an unknown key is a
    ConfigError when the client is built."""
    return {k: v for k, v in (extra_config or {}).items() if k not in _ENGINE_KEYS | _ADAPTER_KEYS}


@dataclasses.dataclass
class KVPoolStorageMetrics(StorageMetrics):  # type: ignore[misc]
    """SGLang's StorageMetrics (pages and GB/s of each batch since the last call, which SGLang turns
    into its `sglang:prefetch_*` / `sglang:backup_*` histograms under `--enable-metrics`) plus kvpool's
    running totals: pages hit and missed by reads, bytes moved, seconds spent in batch reads and writes."""

    hit_pages: int = 0
    miss_pages: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    get_batches: int = 0
    set_batches: int = 0
    get_seconds: float = 0.0
    set_seconds: float = 0.0


class _Recorder:
    """Counts what get_stats() reports; thread-safe (SGLang reads from its prefetch thread and writes
    from its backup thread). Per-batch lists are kept only when SGLang collects them, so they cannot
    grow without bound."""

    def __init__(self, per_batch: bool) -> None:
        self._per_batch = per_batch
        self._lock = threading.Lock()
        self._totals = KVPoolStorageMetrics()

    def read(self, pages: int, hits: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            t = self._totals
            t.hit_pages += hits
            t.miss_pages += pages - hits
            t.bytes_read += nbytes
            t.get_batches += 1
            t.get_seconds += seconds
            if self._per_batch:
                t.prefetch_pgs.append(pages)
                t.prefetch_bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    def wrote(self, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            t = self._totals
            t.bytes_written += nbytes
            t.set_batches += 1
            t.set_seconds += seconds
            if self._per_batch:
                t.backup_pgs.append(pages)
                t.backup_bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    def snapshot(self) -> KVPoolStorageMetrics:
        """The totals so far, with the per-batch lists since the last snapshot (then emptied)."""
        with self._lock:
            snap = dataclasses.replace(self._totals)  # shallow: it takes the lists, the totals get new ones
            for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
                setattr(self._totals, name, [])
        return snap


class KVPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's `HiCacheStorage` contract on a kvpool `PoolClient`.

    SGLang's factory constructs it as `KVPoolHiCacheStorage(storage_config, {})` once per rank (the
    second argument is the factory's keyword dict, empty from the engine, unused), then calls
    `register_mem_pool_host(host_pool)` before any I/O. How the pool is reached comes from the
    extra config (see `pool_options`), then `KVPOOL_*` variables; the default is an embedded pool.
    `retry_s` (1.0) is how long an unreachable pool is reported as misses before it is tried again.

    Keys: SGLang's page hashes, namespaced as SGLang's file backend namespaces them (model; TP rank
    and size for MHA, none for MLA, whose pages are the same on every rank and written by one;
    PP/CP/DCP shards), plus the host pool's layout and dtype, since pages of different layouts have
    the same size but not the same byte order. v1 stores one object per pointer of
    `get_page_buffer_meta` (MHA page_first: K and V of all layers; layer_first: one per layer), the
    tensor form one object per flat page; each instance answers `batch_exists` for the form it uses.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.v1 = bool(extra.get("interface_v1", 0))
        self._shard = _shard_namespace(storage_config)
        self._prefix = self._shard  # completed with the layout once the host pool is registered
        self._parts: list[str] = _PAGE  # the v1 path's parts replace it once the host pool is registered
        self._page_tokens = 0
        self._stats = _Recorder(per_batch=storage_config.enable_storage_metrics)
        opts = pool_options(extra)
        self._io = HostIO(lambda: PoolClient(**opts), logger=log, retry_s=float(extra.get("retry_s", 1.0)))
        log.info("kvpool HiCache storage: %s, keys %s*, %s", opts or "KVPOOL_* settings", self._shard,
                 "zero-copy v1" if self.v1 else "tensor form")

    # ----- registration (once, before any I/O) ---------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Remember the host KV pool and make its buffers addressable for the pointer path."""
        super().register_mem_pool_host(mem_pool_host)
        # as SGLang's Mooncake backend finds them: split K/V pools list theirs, the others have kv_buffer
        buffers = getattr(mem_pool_host, "get_hybrid_pool_buffer", lambda: [getattr(mem_pool_host, "kv_buffer", None)])
        for buf in buffers():
            if isinstance(buf, torch.Tensor) and buf.numel() > 0:
                self._io.buffers.register(buf.data_ptr(), buf.numel() * buf.element_size())
        cfg = self.storage_config
        dcp = cfg.dcp_size > 1 and cfg.logical_page_size
        self._page_tokens = cfg.logical_page_size if dcp else mem_pool_host.page_size
        dtype = str(getattr(mem_pool_host, "dtype", "")).removeprefix("torch.")
        self._prefix = f"{self._shard}{getattr(mem_pool_host, 'layout', '')}/{dtype}/"
        if self.v1:
            try:
                ptrs, _ = mem_pool_host.get_page_buffer_meta(torch.arange(self._page_tokens, dtype=torch.int64))
            except (ValueError, NotImplementedError) as e:
                self._io.once("layout", "kvpool: host pool layout %r has no zero-copy page meta (%s); every v1 "
                              "call will miss. Drop interface_v1 from the extra config to use the tensor form",
                              getattr(mem_pool_host, "layout", None), e)
                ptrs = []
            self._parts = [f".{j}" for j in range(len(ptrs))]

    # ----- the zero-copy path (interface_v1) ------------------------------------------------------

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at `host_indices` (page_size slots per key) under `keys`: True per page
        stored (or already present; a page's bytes are fixed by its key)."""
        plan = self._plan(keys, host_indices)
        if plan is None:
            return [False] * len(keys)
        names, ptrs, sizes = plan
        t = time.perf_counter()
        present = self._io.exists(names)
        todo = [i for i, p in enumerate(present) if not p]
        status: list[int] = [Status.OK] * len(names)
        if todo:
            for i, st in zip(todo, self._io.put_from([names[i] for i in todo], [ptrs[i] for i in todo],
                                                      [sizes[i] for i in todo])):
                status[i] = st
        written = sum(sizes[i] for i in todo if status[i] == Status.OK)
        self._stats.wrote(len(keys), written, time.perf_counter() - t)
        return self._per_page([s == Status.OK for s in status], len(keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy the pages of `keys` into the host pool at `host_indices`: True per page read whole.
        A False page's slots may hold partial bytes; SGLang stops at the first False."""
        plan = self._plan(keys, host_indices)
        if plan is None:
            return [False] * len(keys)
        names, ptrs, sizes = plan
        t = time.perf_counter()
        got = self._io.get_into(names, ptrs, sizes)
        ok = self._per_page([n == size for n, size in zip(got, sizes)], len(keys))
        self._stats.read(len(keys), sum(ok), sum(n for n in got if n > 0), time.perf_counter() - t)
        return ok

    def _plan(self, keys: Sequence[str],
              host_indices: torch.Tensor) -> tuple[list[str], list[int], list[int]] | None:
        """(object names, pointers, sizes) of the pages, or None (logged once) when they cannot be
        addressed: no host pool registered, a slot count that does not match, an unsupported layout."""
        host = getattr(self, "mem_pool_host", None)
        if host is None or not self._parts or not self.v1:
            self._io.once("v1 unusable", "kvpool: batch_get_v1/batch_set_v1 need interface_v1 in the extra config, "
                          "a registered host pool and a layout with page meta; reporting failures")
            return None
        if len(host_indices) != len(keys) * self._page_tokens:
            self._io.once("slots", "kvpool: %d host slots for %d pages of %d tokens; reporting failures",
                          len(host_indices), len(keys), self._page_tokens)
            return None
        ptrs, sizes = host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * len(self._parts):
            self._io.once("meta", "kvpool: the host pool gave %d buffers for %d pages (expected %d per page)",
                          len(ptrs), len(keys), len(self._parts))
            return None
        return self._names(keys), ptrs, sizes

    # ----- the tensor form (no interface_v1) ------------------------------------------------------

    def batch_set(self, keys: list[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store each flat page tensor under its key (keys already present are kept): True if all are."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            self._io.once("values", "kvpool: batch_set got %d keys and %s values; reporting a failure",
                          len(keys), None if values is None else len(values))
            return False
        t = time.perf_counter()
        names = self._names(keys, _PAGE)
        todo = [i for i, p in enumerate(self._io.exists(names)) if not p]
        ok = not todo or self._io.call(
            lambda c: c.batch_put([names[i] for i in todo], [values[i] for i in todo]) or True, lambda st: False)
        self._stats.wrote(len(keys), sum(_nbytes(values[i]) for i in todo) if ok else 0, time.perf_counter() - t)
        return ok

    def batch_get(self, keys: list[str], target_locations: Sequence[torch.Tensor] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Read each page into its target tensor (a new flat page when none is given): the tensor,
        or None on a miss."""
        if not keys:
            return []
        if target_locations is None:
            host = getattr(self, "mem_pool_host", None)
            if host is None:
                self._io.once("no host pool", "kvpool: batch_get without targets before register_mem_pool_host")
                return [None] * len(keys)
            target_locations = [host.get_dummy_flat_data_page() for _ in keys]
        t = time.perf_counter()
        names = self._names(keys, _PAGE)
        got = self._io.call(lambda c: c.batch_get_into(names, list(target_locations)), lambda st: [-1] * len(keys))
        out = [dst if n == _nbytes(dst) else None for dst, n in zip(target_locations, got)]
        hits = sum(o is not None for o in out)
        self._stats.read(len(keys), hits, sum(n for n in got if n > 0), time.perf_counter() - t)
        return out

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """`batch_set` of one page."""
        return self.batch_set([key], None if value is None else [value])

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """`batch_get` of one page."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    # ----- queries and housekeeping ---------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` are stored whole (0 when the pool cannot answer)."""
        if not keys or not self._parts:
            return 0
        names = self._names(keys)
        parts = len(self._parts)
        return int(self._io.call(lambda c: c.prefix_match(names) // parts, lambda st: 0))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Remove every block of the pool (every model and rank: the pool keeps no per-namespace
        index). SGLang calls it from its clear-storage admin request."""
        self._io.clear()

    def get_stats(self) -> KVPoolStorageMetrics:
        """What SGLang's storage metrics collector expects, plus kvpool's totals (see the class)."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Close the pool client (SGLang calls it when it detaches the storage)."""
        self._io.close()

    # ----- helpers --------------------------------------------------------------------------------

    def _names(self, keys: Sequence[str], parts: Sequence[str] | None = None) -> list[str]:
        """Pool keys of `keys`' pages: one per part (`self._parts` unless given), page by page."""
        p = self._prefix
        return [f"{p}{k}{s}" for k in keys for s in (self._parts if parts is None else parts)]

    def _per_page(self, flags: list[bool], pages: int) -> list[bool]:
        n = len(self._parts)
        return [all(flags[i * n:(i + 1) * n]) for i in range(pages)]


def _shard_namespace(cfg: HiCacheStorageConfig) -> str:
    """`sglang/<model>/<shard>/`: which rank's share of a page a key names, as SGLang's file backend
    tells shards apart (TP only for MHA: MLA pages are replicated across TP ranks)."""
    shard = "mla" if cfg.is_mla_model else f"tp{cfg.tp_rank}of{cfg.tp_size}"
    if cfg.pp_size > 1:
        shard += f"-pp{cfg.pp_rank}of{cfg.pp_size}"
    if cfg.attn_cp_size > 1:
        shard += f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    if cfg.dcp_size > 1:
        shard += f"-tp{cfg.tp_size}-dcp{cfg.dcp_rank}of{cfg.dcp_size}-page{cfg.logical_page_size}"
    return f"sglang/{cfg.model_name or 'model'}/{shard}/"


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())
