"""kvpool as FastDeploy's KV-cache storage: `--kvcache-storage-backend kvpool`.

FastDeploy's cache transfer manager (one process per TP rank) registers pinned host buffers once,
then moves whole blocks (all layers of K, or of V, or an fp8 scale) between them and the storage by
raw pointer. Its keys are `prefix{version}_{hash}_{rank}_key` / `_value` (and `_key_scale` /
`_value_scale` with block_wise_fp8). FastDeploy has no plugin hook for storage backends:
`kvpool fastdeploy enable` (see `fastdeploy_patch`) adds the branch that constructs `KVPoolStore`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvpool.core import InvalidArgument, PoolClient

from ._hostio import HostIO, Status, model_part, prefixed

try:  # FastDeploy's base class needs paddle; its manager only duck-types, so a plain class also works
    from fastdeploy.cache_manager.transfer_factory.kvcache_storage import KVCacheStorage as _Base
except (ImportError, OSError):
    _Base = object

log = logging.getLogger("kvpool.backends.fastdeploy")

__all__ = ["KVPoolStore", "Status"]


class KVPoolStore(_Base):
    """FastDeploy's `KVCacheStorage` contract on a kvpool `PoolClient`.

    Constructed by the patched cache transfer manager as
    `KVPoolStore(namespace=<model dir name>, tp_rank=<rank>, tp_size=<ranks>, cache_dtype=<its --cache_dtype>)`,
    once per rank process.
    How the pool is reached comes from `KVPOOL_*` variables (`KVPOOL_MODE=embedded|local|cluster`,
    `KVPOOL_WORKER`, `KVPOOL_NATS_URL`, `KVPOOL_DRAM_BYTES`, ...), overridden by `pool_options`
    (any `PoolClient` keyword), or by passing a ready `client` (not closed by `close()`).

    Pointers passed to `batch_set` / `batch_get` must lie inside a buffer given to `register_buffer`
    (FastDeploy registers its staging buffers at start-up); an item that does not gets
    `Status.INVALID_PARAMS` (-600), never an exception, so one bad pointer cannot stop the engine.
    Empty or mismatched argument lists raise InvalidArgument, a ValueError as FastDeploy's Mooncake backend
    raises.
    When the pool is down or times out, reads are misses, writes report `Status.RPC_FAIL` (-900),
    `exists` is False and `query` is 0; the first failure logs a warning, and the pool is retried
    after `retry_s` seconds.
    """

    def __init__(self, namespace: str | None = None, tp_rank: int = 0, tp_size: int = 1, *,
                 cache_dtype: str | None = None, client: PoolClient | None = None, retry_s: float = 1.0,
                 **pool_options: Any) -> None:
        super().__init__()
        self.namespace = model_part(namespace.rstrip("/")) if namespace else ""
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        # FastDeploy's own keys carry the block hash and the rank, not the model, the TP size or the KV
        # dtype: keys are namespaced by all three, so that two deployments sharing a pool never read each
        # other's blocks (a TP-2 rank's bf16 block is as large as a TP-1 block_wise_fp8 one). The model is
        # its path as FastDeploy was given it (the patch's): two fine-tunes in folders of one name differ
        self._prefix = "/".join([*([self.namespace] if self.namespace else []), f"tp{tp_size}",
                                 *([cache_dtype] if cache_dtype else [])]) + "/"
        self._owns_client = client is None
        connect = (lambda: client) if client is not None else (lambda: PoolClient(**pool_options))
        self._io = HostIO(connect, logger=log, retry_s=retry_s)
        log.info("kvpool store for FastDeploy: namespace %r, tp rank %d of %d", self.namespace, tp_rank, tp_size)

    # ----- buffers ------------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, buffer_size: int) -> None:
        """Register [buffer_ptr, buffer_ptr + buffer_size) of host memory (called at start-up, 2 to 4
        times: K and V read/write staging buffers, plus the fp8 scale buffers). Raises ValueError for a
        null pointer, a size <= 0, or memory this process cannot read and write (GPU memory)."""
        self._io.buffers.register(buffer_ptr, buffer_size)

    # ----- the data path ------------------------------------------------------------------------

    def batch_set(self, keys: Sequence[str], target_locations: Sequence[int] | None = None,
                  target_sizes: Sequence[int] | None = None) -> list[int]:
        """Store `target_sizes[i]` bytes at pointer `target_locations[i]` under `keys[i]` (a key already
        present is replaced). Per key: 0, or a negative `Status`."""
        locs, sizes = _check_lists(keys, target_locations, target_sizes)
        return [int(s) for s in self._io.batch_put_from(self._keys(keys), locs, sizes)]

    def batch_get(self, keys: Sequence[str], target_locations: Sequence[int] | None = None,
                  target_sizes: Sequence[int] | None = None) -> list[int]:
        """Copy each block to pointer `target_locations[i]` (room for `target_sizes[i]` bytes). Per key:
        the bytes read (> 0), `Status.OBJECT_NOT_FOUND` (-704) on a miss, or another negative `Status`
        (INVALID_PARAMS when the block is larger or smaller than the room given: FastDeploy takes any
        positive count as the whole block loaded, and its blocks are all of one size)."""
        locs, sizes = _check_lists(keys, target_locations, target_sizes)
        got = [int(s) for s in self._io.batch_get_into(self._keys(keys), locs, sizes, exact=True)]
        return got

    def set(self, key: str, target_location: int | None = None, target_size: int | None = None) -> int:
        """`batch_set` of one key: 0 or a negative `Status`."""
        return self.batch_set([key], [target_location] if target_location is not None else None,
                              [target_size] if target_size is not None else None)[0]

    def get(self, key: str, target_location: int | None = None, target_size: int | None = None) -> int:
        """`batch_get` of one key: bytes read (> 0) or a negative `Status`."""
        return self.batch_get([key], [target_location] if target_location is not None else None,
                              [target_size] if target_size is not None else None)[0]

    # ----- queries ------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> dict[str, bool]:
        """{key: present} for each key (all False when the pool is unavailable)."""
        return dict(zip(keys, self._io.batch_exists(self._keys(keys))))

    def query(self, k_keys: Sequence[str], v_keys: Sequence[str], k_scale_keys: Sequence[str] | None = None,
              v_scale_keys: Sequence[str] | None = None, timeout: float = 1.0) -> int:
        """How many leading blocks have every key present: K and V, and both scales when both scale lists
        are given (block_wise_fp8): the pool's prefix match over the keys laid out block by block.
        `timeout` is accepted for FastDeploy's signature; each pool call is bounded by the client's
        `timeout_s` instead."""
        if len(k_keys) != len(v_keys):
            raise InvalidArgument(f"{len(k_keys)} k_keys but {len(v_keys)} v_keys; they must match")
        groups = [list(k_keys), list(v_keys)]
        if k_scale_keys is not None and v_scale_keys is not None:
            if not len(k_scale_keys) == len(v_scale_keys) == len(k_keys):
                raise InvalidArgument(f"{len(k_scale_keys)} k_scale_keys and {len(v_scale_keys)} v_scale_keys "
                                      f"for {len(k_keys)} blocks; they must match")
            groups += [list(k_scale_keys), list(v_scale_keys)]
        n = len(k_keys)
        if n == 0:
            return 0
        names = self._keys([g[block] for block in range(n) for g in groups])  # block by block
        return int(self._io.call(lambda c: c.prefix_match(names) // len(groups), lambda st: 0))

    # ----- removal ------------------------------------------------------------------------------

    def delete(self, key: str, timeout: float = 5) -> bool:
        """Remove one block: True if it was removed. While the pool is unreachable, retries until
        `timeout` seconds have passed (as FastDeploy's Mooncake backend does)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self._io.batch_remove(self._keys([key]))[0]
            if st != Status.RPC_FAIL or time.monotonic() >= deadline or self._io.closed:
                return st == Status.OK  # (a closed store never answers again: no wait for it)
            time.sleep(min(self._io.retry_s, max(0.0, deadline - time.monotonic())))

    def clear(self) -> bool:
        """Remove every block of the pool (every namespace: the pool has no per-namespace index).
        True on success, False when the pool is unavailable."""
        return self._io.clear() >= 0

    def close(self) -> None:
        """Close the pool client this store created (a client passed in is left open)."""
        if self._owns_client:
            self._io.close()

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return prefixed(self._prefix, keys)


def _check_lists(keys: Sequence[str], locations: Sequence[int] | None,
                 sizes: Sequence[int] | None) -> tuple[Sequence[int], Sequence[int]]:
    if locations is None or sizes is None:
        raise InvalidArgument("target_locations and target_sizes are required (pointers into registered buffers)")
    if not len(keys) == len(locations) == len(sizes):
        raise InvalidArgument(f"{len(keys)} keys, {len(locations)} target_locations and {len(sizes)} "
                              "target_sizes; the lengths must match")
    if len(keys) == 0:
        raise InvalidArgument("keys, target_locations and target_sizes are empty; pass at least one block")
    return locations, sizes
