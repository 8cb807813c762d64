"""kvpool as SGLang's HiCache L3 storage, loaded by SGLang's dynamic storage backend.

`--hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
"module_path": "kvpool.backends.sglang", "class_name": "KVPoolHiCacheStorage", "interface_v1": 1, ...}'`
(examples/sglang/). With `"interface_v1": 1` SGLang's cache controller hands over host-pool slot
indices and the pages move by pointer between its host KV pool and the pool, one copy each way;
without it, it hands over flat page tensors (the "tensor form"). Either way pool failures become
misses and failed writes, logged once, so the scheduler never sees an exception from the pool.
Hybrid models' side pools (Mamba, SWA, indexer, DeepSeek-V4, draft) go through HiCache v2
(`register_mem_host_pool_v2`, `batch_*_v2`; see `_sglang_v2`).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvpool.core import PoolClient

from ._hostio import HostIO, Status, model_part
from ._sglang_keys import page_format, shard, side_shard, split_factor
from ._sglang_v2 import SidePools, fold_hits, host_regions

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
class KVPoolStorageMetrics(StorageMetrics):
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


class KVPoolHiCacheStorage(HiCacheStorage):
    """SGLang's `HiCacheStorage` contract on a kvpool `PoolClient`.

    SGLang's factory constructs it as `KVPoolHiCacheStorage(storage_config, {})` once per rank (the
    second argument is the factory's keyword dict, empty from the engine, unused), then calls
    `register_mem_pool_host(host_pool)` before any I/O, and for a hybrid model
    `register_mem_host_pool_v2(pool, name)` per pool. How the pool is reached comes from the extra
    config (see `pool_options`), then `KVPOOL_*` variables; the default is an embedded pool.
    `retry_s` (1.0) is how long an unreachable pool is reported as misses before it is tried again.

    Keys: `sglang/<model>/<shard>/<layout>/<dtype>/<page hash>.<part>`. The shard is which rank's
    share of a page a key names, as SGLang's file backend tells shards apart (`tp<r>of<n>` for MHA,
    `mla` for pages that are the same on every rank and written by one; PP/CP/DCP shards); layout and
    dtype are the host pool's, since pages of different layouts have the same size but not the same
    byte order. v1 stores one object per pointer of `get_page_buffer_meta` (MHA page_first: K and V
    of all layers; layer_first: one per layer), the tensor form one object per flat page; each
    instance answers `batch_exists` for the form it uses. A side pool's objects are under
    `<its shard>/<layout>/<dtype>/<pool>/<its layout>/<its dtype>/`.

    Across TP sizes: with SGLang's `tp_lcm_size` in the extra config and the `page_head` layout,
    an MHA rank stores its K and V per group of KV heads, named by the group's rank among
    `tp_lcm_size` (`tp<g>of<lcm>`), so instances with any TP size dividing `tp_lcm_size` share pages.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.v1 = bool(extra.get("interface_v1", 0))
        self._model = f"sglang/{model_part(storage_config.model_name or 'model')}/"
        self._shard = shard(storage_config)
        self._format = ""  # "<layout>/<dtype>/" of the host pool, once registered
        self._kv: list[tuple[str, str]] = []  # (prefix, suffix) of each part of a page on the v1 path
        self._split = 0  # head groups per page when SGLang splits heads (tp_lcm_size, page_head)
        self._logical = False  # the KV anchor holds no bytes (DeepSeek-V4): side pools carry the data
        self._page_tokens = 0
        self._stats = _Recorder(per_batch=storage_config.enable_storage_metrics)
        opts = pool_options(extra)
        self._io = HostIO(lambda: PoolClient(**opts), logger=log, retry_s=float(extra.get("retry_s", 1.0)))
        self._side = SidePools(self._io)
        log.info("kvpool HiCache storage: %s, keys %s%s*, %s", opts or "KVPOOL_* settings", self._model, self._shard,
                 "zero-copy v1" if self.v1 else "tensor form")

    @property
    def _prefix(self) -> str:
        """The key prefix of this rank's own KV pages (the tensor form's, and v1's unless heads are split)."""
        return f"{self._model}{self._shard}{self._format}"

    # ----- registration (once, before any I/O) ---------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Remember the host KV pool and make its buffers addressable for the pointer path."""
        super().register_mem_pool_host(mem_pool_host)
        self._logical = getattr(mem_pool_host, "kv_buffer", None) is None
        for ptr, size in host_regions(mem_pool_host):
            self._io.buffers.register(ptr, size)
        cfg = self.storage_config
        dcp = cfg.dcp_size > 1 and cfg.logical_page_size
        self._page_tokens = cfg.logical_page_size if dcp else mem_pool_host.page_size
        self._format = page_format(mem_pool_host)
        self._split = split_factor(cfg) if getattr(mem_pool_host, "layout", "") == "page_head" else 0
        if self._logical or not self.v1:
            return
        try:
            ptrs, _ = self._meta(mem_pool_host, torch.arange(self._page_tokens, dtype=torch.int64))
        except (ValueError, NotImplementedError, AssertionError) as e:
            self._io.once("layout", "kvpool: host pool layout %r has no zero-copy page meta (%s); every v1 "
                          "call will miss. Drop interface_v1 from the extra config to use the tensor form",
                          getattr(mem_pool_host, "layout", None), e)
            return
        if self._split:
            lcm, first = self._split * cfg.tp_size, cfg.tp_rank * self._split
            self._kv = [(f"{self._model}{shard(cfg, tp=(first + j // 2, lcm))}{self._format}", f".{j % 2}")
                        for j in range(len(ptrs))]
        else:
            self._kv = [(self._prefix, f".{j}") for j in range(len(ptrs))]

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Remember a pool of a hybrid model (SGLang calls it once per pool after
        `register_mem_pool_host`, and again for pools added later). The KV anchor itself needs nothing
        more; any other pool gets its own key prefix (see the class) and its buffers registered."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool is getattr(self, "mem_pool_host", None) and str(host_pool_name) == PoolName.KV.value:
            return
        pool_shard = side_shard(self.storage_config, str(host_pool_name), host_pool)
        pool = self._side.register(host_pool_name, host_pool, f"{self._model}{pool_shard}{self._format}"
                                   f"{host_pool_name}/{page_format(host_pool)}")
        log.info("kvpool: HiCache pool %s (%s): %s", host_pool_name, type(host_pool).__name__,
                 f"{pool.parts} zero-copy objects per page" if pool.zero_copy
                 else "no bytes" if pool.parts == 0 else "one flat page per key")

    # ----- the zero-copy path (interface_v1) ------------------------------------------------------

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at `host_indices` (page_size slots per key) under `keys`: True per page
        stored (or already present; a page's bytes are fixed by its key). A KV anchor without bytes
        (DeepSeek-V4) reports True: its side pools carry the pages, through `batch_set_v2`."""
        if self._logical:
            return [True] * len(keys)
        plan = self._plan(keys, host_indices)
        if plan is None:
            return [False] * len(keys)
        names, ptrs, sizes = plan
        t = time.perf_counter()
        present = self._io.batch_exists(names)
        todo = [i for i, p in enumerate(present) if not p]
        status: list[int] = [Status.OK] * len(names)
        if todo:
            for i, st in zip(todo, self._io.batch_put_from([names[i] for i in todo], [ptrs[i] for i in todo],
                                                      [sizes[i] for i in todo])):
                status[i] = st
        written = sum(sizes[i] for i in todo if status[i] == Status.OK)
        self._stats.wrote(len(keys), written, time.perf_counter() - t)
        return self._per_page([s == Status.OK for s in status], len(keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy the pages of `keys` into the host pool at `host_indices`: True per page read whole.
        A False page's slots may hold partial bytes; SGLang stops at the first False."""
        if self._logical:
            return [True] * len(keys)
        plan = self._plan(keys, host_indices)
        if plan is None:
            return [False] * len(keys)
        names, ptrs, sizes = plan
        t = time.perf_counter()
        got = self._io.batch_get_into(names, ptrs, sizes)
        ok = self._per_page([n == size for n, size in zip(got, sizes)], len(keys))
        self._stats.read(len(keys), sum(ok), sum(n for n in got if n > 0), time.perf_counter() - t)
        return ok

    def _meta(self, host: Any, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """(pointers, sizes) of the pages at `indices`, as the (untyped) SGLang host pool gives them."""
        meta: tuple[list[int], list[int]]
        if self._split:
            meta = host.get_split_heads_page_buffer_meta(indices, self._split)
        else:
            meta = host.get_page_buffer_meta(indices)
        return meta

    def _plan(self, keys: Sequence[str],
              host_indices: torch.Tensor) -> tuple[list[str], list[int], list[int]] | None:
        """(object names, pointers, sizes) of the pages, or None (logged once) when they cannot be
        addressed: no host pool registered, a slot count that does not match, an unsupported layout."""
        host = getattr(self, "mem_pool_host", None)
        if host is None or not self._kv or not self.v1:
            self._io.once("v1 unusable", "kvpool: batch_get_v1/batch_set_v1 need interface_v1 in the extra config, "
                          "a registered host pool and a layout with page meta; reporting failures")
            return None
        if len(host_indices) != len(keys) * self._page_tokens:
            self._io.once("slots", "kvpool: %d host slots for %d pages of %d tokens; reporting failures",
                          len(host_indices), len(keys), self._page_tokens)
            return None
        ptrs, sizes = self._meta(host, host_indices)
        if len(ptrs) != len(keys) * len(self._kv):
            self._io.once("meta", "kvpool: the host pool gave %d buffers for %d pages (expected %d per page)",
                          len(ptrs), len(keys), len(self._kv))
            return None
        return self._names(keys), ptrs, sizes

    # ----- HiCache v2: the side pools of hybrid models --------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix of `keys`: the KV pages stored whole from the start (every page when the
        anchor holds no bytes and some pool decides), cut by each pool's hit policy (see
        `_sglang_v2.fold_hits`), with every restorable stop point for SGLang to agree on across ranks."""
        transfers = list(pool_transfers or [])
        kv_pages = (len(keys) if transfers else 0) if self._logical else self.batch_exists(keys, extra_info)
        return fold_hits(kv_pages, transfers, lambda t, n: self._side.present(t, keys[:n]))

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's pages (`keys`, `host_indices` of its pool) into its host pool: per pool
        name, True per page read whole. All zero-copy pools move in one pool call."""
        t = time.perf_counter()
        out, nbytes = self._side.transfer(transfers, write=False)
        pages = sum(len(v) for v in out.values())
        self._stats.read(pages, sum(sum(v) for v in out.values()), nbytes, time.perf_counter() - t)
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store each transfer's pages: per pool name, True per page stored (or already present)."""
        t = time.perf_counter()
        out, nbytes = self._side.transfer(transfers, write=True)
        self._stats.wrote(sum(len(v) for v in out.values()), nbytes, time.perf_counter() - t)
        return out

    # ----- the tensor form (no interface_v1) ------------------------------------------------------

    def batch_set(self, keys: list[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store each flat page tensor under its key (keys already present are kept): True if all are."""
        if not keys or self._logical:
            return True
        if values is None or len(values) != len(keys):
            self._io.once("values", "kvpool: batch_set got %d keys and %s values; reporting a failure",
                          len(keys), None if values is None else len(values))
            return False
        t = time.perf_counter()
        names = self._names(keys, _PAGE)
        todo = [i for i, p in enumerate(self._io.batch_exists(names)) if not p]
        ok = not todo or self._io.call(  # batch_put returns None; the fallback, the failure's Status
            lambda c: c.batch_put([names[i] for i in todo], [values[i] for i in todo]), lambda st: st,
            proves=True) is None
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
        if self._logical:
            return list(target_locations)
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
        """How many leading pages of `keys` are stored whole (0 when the pool cannot answer, and for
        an anchor without bytes, whose pages only `batch_exists_v2` can answer for)."""
        parts = len(self._kv) if self.v1 else 1
        if not keys or not parts or self._logical:
            return 0
        names = self._names(keys)
        return int(self._io.call(lambda c: c.prefix_match(names) // parts, lambda st: 0))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Remove this backend's blocks: every block under the key prefixes this rank writes (its KV
        shard or head groups and its side pools, in this model, layout and dtype). Other models,
        layouts, dtypes and shards are left alone; SGLang's clear-storage request reaches every rank,
        so together they clear the model's namespace."""
        prefixes = {self._prefix, *(p for p, _ in self._kv), *(pool.prefix for pool in self._side.pools.values())}
        for prefix in sorted(prefixes):
            if not any(prefix.startswith(p) and prefix != p for p in prefixes):
                self._io.clear(prefix)

    def get_stats(self) -> KVPoolStorageMetrics:
        """What SGLang's storage metrics collector expects, plus kvpool's totals (see the class)."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Close the pool client (SGLang calls it when it detaches the storage)."""
        self._io.close()

    # ----- helpers --------------------------------------------------------------------------------

    def _names(self, keys: Sequence[str], parts: Sequence[str] | None = None) -> list[str]:
        """Pool keys of `keys`' KV pages: one per part (v1's parts unless `parts`, suffixes under this
        rank's own prefix, are given), page by page."""
        if parts is not None or not self.v1:
            p = self._prefix
            return [f"{p}{k}{s}" for k in keys for s in (parts or _PAGE)]
        return [f"{p}{k}{s}" for k in keys for p, s in self._kv]

    def _per_page(self, flags: list[bool], pages: int) -> list[bool]:
        n = len(self._kv)
        return [all(flags[i * n:(i + 1) * n]) for i in range(pages)]


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())
