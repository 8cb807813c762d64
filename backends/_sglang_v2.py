"""SGLang HiCache v2 for `KVPoolHiCacheStorage`: the side pools of hybrid models (Mamba state, SWA,
DSA indexer, DeepSeek-V4 compressed caches, draft models...) beside the main KV pool.

As upstream (Mooncake, HF3FS, NIXL) does it: the main KV moves through v1, each side pool is one more
set of objects under its own key prefix, and `batch_exists_v2` folds the pools' hit policies over the
KV prefix. A pool whose host class gives zero-copy page meta moves each part of a page (a pointer of
`get_page_buffer_meta`) as one object; any other pool moves one flat page per key through its
`get_data_page` / `set_from_flat_data_page`. A pool with no bytes (DeepSeek-V4's logical anchor) is
always present and every transfer of it succeeds.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from kvpool.core import InvalidArgument

from ._hostio import HostIO, Status

log = logging.getLogger("kvpool.backends.sglang")

__all__ = ["SidePool", "SidePools", "fold_hits", "host_regions"]

_NO_META = (ValueError, NotImplementedError, AssertionError, TypeError)
"""What SGLang's host pools raise from `get_page_buffer_meta` for a layout or state they cannot
describe (several assert): such a pool moves flat pages instead."""


def host_regions(host: Any) -> list[tuple[int, int]]:
    """(address, bytes) of the memory behind the CPU tensors a host pool keeps (its buffers and
    their views, in any attribute, list or tuple), overlapping ones merged: what must be registered
    so that every pointer of its page meta is addressable. A view (MHA's `k_buffer`) shares its base
    address with its buffer, so registering both separately would let the smaller one win."""
    spans: list[tuple[int, int]] = []

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 0:
            start = t.data_ptr()
            spans.append((start, start + int(t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())))

    for t in getattr(host, "get_hybrid_pool_buffer", lambda: [])():
        add(t)
    for value in vars(host).values():
        for t in value if isinstance(value, (list, tuple)) else (value,):
            add(t)
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


@dataclasses.dataclass
class SidePool:
    """One registered pool: its objects are `{prefix}{page key}.{j}` for j < parts."""

    name: str
    host: Any
    prefix: str
    page_tokens: int
    parts: int
    """Objects per page; 0 for a pool that holds no bytes."""
    zero_copy: bool
    """True: parts are the pointers of `get_page_buffer_meta`; False: one flat page."""

    def names(self, keys: Iterable[str]) -> list[str]:
        return [f"{self.prefix}{k}.{j}" for k in keys for j in range(self.parts)]


def describe(name: str, host: Any, prefix: str) -> SidePool:
    """How `host`'s pages are stored: its page meta for one page decides zero copy and parts."""
    page = int(getattr(host, "page_size", 1) or 1)
    try:
        meta = host.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
    except _NO_META as e:
        log.info("kvpool: pool %s (%s) has no zero-copy page meta (%s); it moves flat pages", name,
                 type(host).__name__, e)
        return SidePool(str(name), host, prefix, page, 1, False)
    if meta is None:
        return SidePool(str(name), host, prefix, page, 0, False)
    ptrs, sizes = meta
    if not ptrs or any(isinstance(p, Sequence) for p in ptrs) or min(int(s) for s in sizes) <= 0:
        return SidePool(str(name), host, prefix, page, 1, False)
    return SidePool(str(name), host, prefix, page, len(ptrs), True)


def fold_hits(kv_pages: int, transfers: Sequence[PoolTransfer],
              present: Callable[[PoolTransfer, int], list[bool]]) -> PoolTransferResult:
    """SGLang's v2 hit result for a KV prefix of `kv_pages` pages, given which of those pages each
    pool holds whole (`present(transfer, kv_pages)`).

    ALL_PAGES keeps the stop points up to the pool's first missing page; TRAILING_PAGES keeps each
    stop point whose window of `len(transfer.keys)` pages (at least 1) ending there is present, so the
    result may have holes; BLOCK_GROUPS reports the pages its leading complete groups of
    `group_pages` pages cover and never shortens the KV hit. `kv_hit_pages` is the longest stop point
    every pool allows; each pool's own boundary goes to `extra_pool_hit_pages`.
    """
    hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        have = present(transfer, kv_pages)
        policy = transfer.hit_policy
        if policy == PoolHitPolicy.ALL_PAGES:
            boundary = have.index(False) if False in have else kv_pages
            allowed = set(range(1, boundary + 1))
        elif policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(transfer.keys or ()))
            allowed = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - window):n])}
            boundary = max(allowed, default=0)
        elif policy == PoolHitPolicy.BLOCK_GROUPS:
            group = max(1, int(transfer.group_pages or 1))
            groups = 0
            while (groups + 1) * group <= kv_pages and all(have[groups * group:(groups + 1) * group]):
                groups += 1
            boundary, allowed = groups * group, set(restorable)
        else:
            raise InvalidArgument(f"unsupported pool hit policy {policy!r} for pool {transfer.name}")
        if boundary:
            hits[transfer.name] = boundary
        restorable = [p for p in restorable if p in allowed]
    return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)


class SidePools:
    """The v2 pools of one backend, moved through its HostIO (one pool call per batch for all
    zero-copy pools together)."""

    def __init__(self, io: HostIO) -> None:
        self._io = io
        self.pools: dict[str, SidePool] = {}
        """By `str(pool name)`: SGLang's PoolName is a str enum whose hash is not its value's."""

    def register(self, name: str, host: Any, prefix: str) -> SidePool:
        """Describe `host` and make its buffers addressable; re-registering a name replaces it."""
        pool = describe(name, host, prefix)
        if pool.zero_copy:
            for ptr, size in host_regions(host):
                self._io.buffers.register(ptr, size)
        self.pools[str(name)] = pool
        return pool

    def present(self, transfer: PoolTransfer, keys: Sequence[str]) -> list[bool]:
        """Per key of `keys`: True if every part of the page is stored in `transfer`'s pool (all False
        for an unregistered pool, all True for a pool without bytes)."""
        pool = self.pools.get(str(transfer.name))
        if pool is None:
            self._io.once(f"unregistered {transfer.name}", "kvpool: no host pool registered as %r; its pages "
                          "are reported missing", transfer.name)
            return [False] * len(keys)
        if pool.parts == 0:
            return [True] * len(keys)
        flags = self._io.batch_exists(pool.names(keys))
        n = pool.parts
        return [all(flags[i * n:(i + 1) * n]) for i in range(len(keys))]

    # ----- transfers ------------------------------------------------------------------------------

    def transfer(self, transfers: Sequence[PoolTransfer], write: bool) -> tuple[dict[str, list[bool]], int]:
        """Read (or write) every transfer's pages: ({pool name: ok per key}, bytes moved)."""
        out: dict[str, list[bool]] = {}
        names: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        spans: list[tuple[str, int, int, int]] = []  # (pool name, first object, objects, parts per page)
        moved = 0
        for t in transfers:
            keys = list(t.keys or [])
            pool = self._checked(t, keys)
            if pool is None:
                out[t.name] = [False] * len(keys)
            elif pool.parts == 0 or not keys:
                out[t.name] = [True] * len(keys)
            elif not pool.zero_copy:
                out[t.name], nbytes = self._flat(pool, keys, t.host_indices, write)
                moved += nbytes
            else:
                p, s = pool.host.get_page_buffer_meta(t.host_indices)
                if len(p) != len(keys) * pool.parts:
                    self._io.once(f"meta {pool.name}", "kvpool: pool %s gave %d buffers for %d pages (expected %d "
                                  "per page); reporting failures", pool.name, len(p), len(keys), pool.parts)
                    out[t.name] = [False] * len(keys)
                    continue
                spans.append((t.name, len(names), len(p), pool.parts))
                names += pool.names(keys)
                ptrs += [int(x) for x in p]
                sizes += [int(x) for x in s]
        if spans:
            ok, moved_zero_copy = self._zero_copy(names, ptrs, sizes, write)
            moved += moved_zero_copy
            for name, start, count, parts in spans:
                flags = ok[start:start + count]
                out[name] = [all(flags[i:i + parts]) for i in range(0, count, parts)]
        return out, moved

    def _checked(self, t: PoolTransfer, keys: list[str]) -> SidePool | None:
        pool = self.pools.get(str(t.name))
        if pool is None:
            self._io.once(f"unregistered {t.name}", "kvpool: no host pool registered as %r; reporting failures",
                          t.name)
            return None
        slots = 0 if t.host_indices is None else int(t.host_indices.numel())
        if pool.parts and slots != len(keys) * pool.page_tokens:
            self._io.once(f"slots {t.name}", "kvpool: pool %s got %d host slots for %d pages of %d slots; "
                          "reporting failures", t.name, slots, len(keys), pool.page_tokens)
            return None
        return pool

    def _zero_copy(self, names: list[str], ptrs: list[int], sizes: list[int],
                   write: bool) -> tuple[list[bool], int]:
        if not write:
            got = self._io.batch_get_into(names, ptrs, sizes)
            ok = [n == size for n, size in zip(got, sizes)]
            return ok, sum(n for n in got if n > 0)
        present = self._io.batch_exists(names)
        todo = [i for i, p in enumerate(present) if not p]
        ok = list(present)
        if todo:
            for i, st in zip(todo, self._io.batch_put_from([names[i] for i in todo], [ptrs[i] for i in todo],
                                                      [sizes[i] for i in todo])):
                ok[i] = st == Status.OK
        return ok, sum(sizes[i] for i in todo if ok[i])

    def _flat(self, pool: SidePool, keys: list[str], host_indices: torch.Tensor,
              write: bool) -> tuple[list[bool], int]:
        """One flat page per key, copied through the pool's own page accessors."""
        slots = [int(host_indices[i * pool.page_tokens]) for i in range(len(keys))]
        names = pool.names(keys)
        if write:
            todo = [i for i, p in enumerate(self._io.batch_exists(names)) if not p]
            pages = [pool.host.get_data_page(slots[i], flat=True).contiguous() for i in todo]
            stored = not todo or self._io.call(  # batch_put returns None; the fallback, the failure's Status
                lambda c: c.batch_put([names[i] for i in todo], pages), lambda st: st, proves=True) is None
            return [stored] * len(keys), sum(_nbytes(p) for p in pages) if stored and todo else 0
        dsts = [pool.host.get_dummy_flat_data_page() for _ in keys]
        got = self._io.call(lambda c: c.batch_get_into(names, dsts), lambda st: [-1] * len(keys))
        ok = [n == _nbytes(d) for n, d in zip(got, dsts)]
        for slot, dst, hit in zip(slots, dsts, ok):
            if hit:
                pool.host.set_from_flat_data_page(slot, dst)
        return ok, sum(n for n in got if n > 0)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())
