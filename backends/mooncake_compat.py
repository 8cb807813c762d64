"""A drop-in for `mooncake.store.MooncakeDistributedStore` that keeps the blocks in kvpool.

Integrations written against Mooncake Store (FastDeploy's and SGLang's `mooncake_store.py`, vLLM's
and LMCache's Mooncake connectors) call `setup(...)`, `register_buffer`, `batch_put_from`,
`batch_get_into`, `batch_is_exist`, `put` / `get`, `remove`, ... and test Mooncake's integer status
codes. With `PYTHONPATH=$(kvpool mooncake-shim)` their `from mooncake.store import
MooncakeDistributedStore` resolves to this class, so they run on kvpool unchanged.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from kvpool.core import MAX_KEY_BYTES, ClientConfig, KVPoolError, PoolClient, readable
from kvpool.core import load_config as load

from ._hostio import HostBuffers, HostIO, Status, prefixed
from .mooncake_shim import shim_path

log = logging.getLogger("kvpool.backends.mooncake")

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "Status", "pool_options", "shim_path"]

_MIN_EMBEDDED_BYTES = 16 << 20
"""Smallest embedded pool that `global_segment_size` may size (one DRAM slab)."""

DEFAULT_TENANT = "default"
"""Mooncake's tenant when none is named: its objects carry no prefix."""


def pool_options(master_server_addr: str | None, metadata_server: str | None = None,
                 global_segment_size: int = 0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The `PoolClient` options that Mooncake's `setup` addresses mean.

    The first of `master_server_addr`, `metadata_server` that names a kvpool pool decides:
    - `nats://...` or `tls://...`   -> cluster mode at that NATS server (`kvpool up` prints it)
    - `/path/to/worker.sock`        -> local mode, that worker through shared memory
    - `host:port`                   -> local mode, that worker over TCP
    - `embedded`                    -> a pool inside this process
    Anything else (empty, `kvpool`, `P2PHANDSHAKE`, `http://...` / `etcd://...` metadata servers) names
    no pool: then the `KVPOOL_*` variables decide as they do for PoolClient (`KVPOOL_NATS_URL` alone
    means cluster mode, `KVPOOL_WORKER` alone local mode), and with none set the pool is embedded.
    In embedded mode `global_segment_size` (the memory a Mooncake client contributes) sizes the DRAM
    arena, unless `KVPOOL_DRAM_BYTES` is set. Other KVPOOL_* options (token, timeout, replication)
    always come from the environment.
    """
    env = dict(os.environ) if env is None else env
    opts: dict[str, Any] = {}
    for addr in (master_server_addr, metadata_server):
        a = (addr or "").strip()
        if a.startswith(("nats://", "tls://")):
            opts = {"mode": "cluster", "nats_url": a}
        elif a == "embedded":
            opts = {"mode": "embedded"}
        elif a.startswith("/") or _is_host_port(a):
            opts = {"mode": "local", "worker": a}
        else:
            continue
        break
    mode = opts.get("mode") or _env_mode(env)
    if mode == "embedded" and global_segment_size >= _MIN_EMBEDDED_BYTES and "KVPOOL_DRAM_BYTES" not in env:
        opts["dram_bytes"] = int(global_segment_size)
    return opts


def _env_mode(env: dict[str, str]) -> str:
    """The mode PoolClient takes from these variables (ClientConfig's inference: an explicit
    KVPOOL_MODE, else cluster with KVPOOL_NATS_URL, local with KVPOOL_WORKER, else embedded)."""
    cfg = load(ClientConfig, env=env)
    return str(cfg.mode)


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit()) and "://" not in addr


LONG_KEY_MARK = "kvpool-long-key/sha256:"
"""A key too long for the pool (with its tenant's prefix: over `MAX_KEY_BYTES` bytes) is stored under this
mark and its key's SHA-256: Mooncake takes keys of any length, and engines build them from model paths."""


class BufferHandle(bytes):
    """An object's bytes as Mooncake's `get_buffer` / `batch_get_buffer` hand them out: the buffer protocol
    (`memoryview(h)`, `np.frombuffer(h)`), `len(h)` and `h.size()`; `h.ptr()` is the bytes' address (valid
    while `h` lives)."""

    def size(self) -> int:
        return len(self)

    def ptr(self) -> int:
        import ctypes

        return ctypes.cast(ctypes.c_char_p(self), ctypes.c_void_p).value or 0


class ReplicateConfig:
    """Accepted wherever Mooncake takes one, and ignored: copies per block are the pool's setting
    (`KVPOOL_REPLICATION` in cluster mode)."""

    def __init__(self, **fields: Any) -> None:
        self.replica_num = 1
        self.__dict__.update(fields)


class MooncakeDistributedStore:
    """Mooncake Store's client API on a kvpool `PoolClient`.

    Statuses are Mooncake's (`Status`): 0 ok, -600 INVALID_PARAMS, -704 OBJECT_NOT_FOUND (a miss),
    -900 RPC_FAIL (pool unreachable). Differences from Mooncake, all in the safe direction:
    - a put of an existing key replaces it (Mooncake keeps the first); both return 0;
    - there are no leases to wait for: `remove` right after a `get` succeeds;
    - `is_exist` / `batch_is_exist` report 0, not -1, when the pool cannot answer (callers that test
      truthiness, as FastDeploy's `query` does, would read -1 as present);
    - `batch_get_into` / `get_into` of an object smaller than the room given is -600, not its size:
      SGLang and FastDeploy take any positive count as the whole page loaded, and an instance of
      another layout (another TP size) may have stored a smaller object under the same key;
    - `protocol`, `rdma_devices`, `local_buffer_size` and `ReplicateConfig` are accepted and ignored.
    As in Mooncake, `batch_put_from` / `batch_get_into` pointers must lie inside a buffer given to
    `register_buffer` (INVALID_PARAMS otherwise).
    """

    def __init__(self) -> None:
        self._hostname = ""
        self._prefix = ""  # the tenant's key namespace
        self._buffers = HostBuffers()  # kept across setup() calls
        self._io = HostIO(None, logger=log, buffers=self._buffers)  # until setup(): every call fails

    def setup(self, local_hostname: str | dict[str, Any] = "", metadata_server: str = "",
              global_segment_size: int = 16 << 20, local_buffer_size: int = 16 << 20,
              protocol: str = "tcp", rdma_devices: str = "", master_server_addr: str = "",
              engine: Any = None, *, tenant_id: str = DEFAULT_TENANT, enable_ssd_offload: bool = False,
              ssd_offload_path: str | None = None, **ignored: Any) -> int:
        """Connect to the pool that `master_server_addr` / `metadata_server` name (see `pool_options`).

        Every form Mooncake's callers use is accepted: positional (the eighth argument is a shared
        transfer engine, ignored), keywords, and `setup(config: dict)`. `tenant_id` is honoured as a key
        namespace: tenants never see each other's objects. `enable_ssd_offload` / `ssd_offload_path`
        are accepted and ignored (the pool's SSD tier is its workers' setting; an embedded pool takes
        `KVPOOL_SSD_PATH`). Returns 0, or INVALID_PARAMS (-600) for a configuration kvpool rejects
        (logged). An unreachable pool is not an error here: calls report misses until it answers.
        """
        if isinstance(local_hostname, dict):
            cfg = dict(local_hostname)
            return self.setup(str(cfg.pop("local_hostname", "")), str(cfg.pop("metadata_server", "")),
                              int(cfg.pop("global_segment_size", 16 << 20)),
                              int(cfg.pop("local_buffer_size", 16 << 20)), str(cfg.pop("protocol", "tcp")),
                              str(cfg.pop("rdma_devices", cfg.pop("device_name", ""))),
                              str(cfg.pop("master_server_addr", cfg.pop("master_server_address", ""))), **cfg)
        if ignored:
            log.info("kvpool: setup() options %s have no meaning for kvpool; ignored", sorted(ignored))
        tenant = str(tenant_id or DEFAULT_TENANT)
        self._io.close()
        opts: dict[str, Any] = {}
        try:
            opts = pool_options(master_server_addr, metadata_server, global_segment_size)
            self._io = HostIO(lambda: PoolClient(**opts), logger=log, buffers=self._buffers)
        except (KVPoolError, ValueError) as e:  # Mooncake reports a failed setup as a status
            log.error("kvpool: setup(master_server_addr=%r, metadata_server=%r) failed: %s",
                      master_server_addr, metadata_server, e)
            self._io = HostIO(None, logger=log, buffers=self._buffers)
            return int(Status.INVALID_PARAMS)
        self._hostname = local_hostname
        # '/' (and '%') escaped: tenant "team" with key "x/k" and tenant "team/x" with key "k" were one object
        escaped = str(tenant).replace("%", "%25").replace("/", "%2F")
        self._prefix = "" if tenant == DEFAULT_TENANT else f"tenant/{escaped}/"
        log.info("kvpool Mooncake-API store: %s%s", opts or "KVPOOL_* settings",
                 f", tenant {tenant!r}" if self._prefix else "")
        return 0

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str, **kwargs: Any) -> int:
        """Mooncake's form for a client whose memory a separate local process owns: here the address
        names the pool as `master_server_addr` does (a worker's socket or host:port, a NATS URL)."""
        return self.setup("", "", 0, local_buffer_size, master_server_addr=server_address, **kwargs)

    def _keys(self, keys: Sequence[str]) -> list[str]:
        """The pool's names of `keys`: in the tenant's namespace, a long one by its digest (`LONG_KEY_MARK`)."""
        named = prefixed(self._prefix, keys)
        return [_digest(self._prefix, n) if isinstance(n, str) and len(n) > MAX_KEY_BYTES // 4
                and len(n.encode(errors="surrogatepass")) > MAX_KEY_BYTES else n for n in named]

    # ----- registered buffers -------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Make [buffer_ptr, buffer_ptr + size) usable by the pointer calls: 0, or INVALID_PARAMS."""
        try:
            self._io.buffers.register(buffer_ptr, size)
        except ValueError as e:
            log.error("kvpool: %s", e)
            return int(Status.INVALID_PARAMS)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """0, or INVALID_PARAMS when no buffer is registered at `buffer_ptr`."""
        return 0 if self._io.buffers.unregister(buffer_ptr) else int(Status.INVALID_PARAMS)

    # ----- pointer batches ----------------------------------------------------------------------

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """Store `sizes[i]` bytes at `buffer_ptrs[i]` under `keys[i]`: 0 or a negative status per key."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [int(Status.INVALID_PARAMS)] * len(keys)
        return [int(s) for s in self._io.batch_put_from(self._keys(keys), buffer_ptrs, sizes)]

    batch_upsert_from = batch_put_from

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Copy each object to `buffer_ptrs[i]` (`sizes[i]` bytes): bytes read, -704 on a miss, -600 when
        the object's size is not `sizes[i]`, -900 when the pool is unreachable."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [int(Status.INVALID_PARAMS)] * len(keys)
        return [int(s) for s in self._io.batch_get_into(self._keys(keys), buffer_ptrs, sizes, exact=True)]

    def batch_put_from_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Store under `keys[i]` the concatenation of its parts (`all_buffer_ptrs[i][j]`, `all_sizes[i][j]`
        bytes; SGLang's MLA and layer-first layouts: one part per layer): 0 or a negative status per key."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [int(Status.INVALID_PARAMS)] * len(keys)
        return [int(s) for s in self._io.batch_put_from_parts(self._keys(keys), all_buffer_ptrs, all_sizes)]

    def batch_get_into_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Scatter each object over its parts, in order: total bytes read, -704 on a miss, -600 when the
        object's size is not the parts' total, -900 when the pool is unreachable."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [int(Status.INVALID_PARAMS)] * len(keys)
        return [int(s) for s in self._io.batch_get_into_parts(self._keys(keys), all_buffer_ptrs, all_sizes)]

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size])[0]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    # ----- bytes --------------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store a bytes-like `value` (copied): 0, or a negative status (-600 for an empty value or one
        that is not bytes-like)."""
        try:
            view = readable(value)  # once: a CUDA tensor or strided array is copied here, not again in put
        except KVPoolError as e:
            self._io.once("bad value", "kvpool: put of %r: %s", key, e)
            return int(Status.INVALID_PARAMS)
        if view.nbytes == 0:
            return int(Status.INVALID_PARAMS)
        name = self._keys([key])[0]
        failed = self._io.call(lambda c: c.put(name, view), lambda st: st, proves=True)  # put returns None
        return int(Status.OK if failed is None else failed)

    upsert = put

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of `parts` under `key`."""
        try:
            joined = b"".join(readable(p) for p in parts)
        except KVPoolError as e:
            self._io.once("bad value", "kvpool: put of %r: %s", key, e)
            return int(Status.INVALID_PARAMS)
        return self.put(key, joined, config)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        """Store each value: 0, or the first negative status."""
        if len(keys) != len(values):
            return int(Status.INVALID_PARAMS)
        codes = [self.put(k, v) for k, v in zip(keys, values)]
        return next((c for c in codes if c < 0), 0)

    def get(self, key: str) -> bytes:
        """The object's bytes; b"" on a miss or when the pool is unreachable (as Mooncake)."""
        name = self._keys([key])[0]
        return self._io.call(lambda c: c.get(name) or b"", lambda st: b"")

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes as a buffer (`BufferHandle`), None on a miss or when the pool is unreachable."""
        data = self.get(key)
        return BufferHandle(data) if data else None

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """`get_buffer` of each key (LMCache's Mooncake connector reads this way)."""
        return [self.get_buffer(k) for k in keys]

    def get_size(self, key: str) -> int:
        """The object's size in bytes, -704 on a miss, another negative status on failure."""
        name = self._keys([key])[0]

        def size(c: PoolClient) -> int:
            with c.lease(name) as view:
                return view.nbytes if view is not None else int(Status.OBJECT_NOT_FOUND)
        return int(self._io.call(size, lambda st: st))

    # ----- existence and removal ----------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 if present, else 0."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 per key (0 also when the pool cannot answer)."""
        return [int(f) for f in self._io.batch_exists(self._keys(keys))]

    def remove(self, key: str, force: bool = False) -> int:
        """0 if removed, -704 if absent, -900 when the pool is unreachable."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return [int(s) for s in self._io.batch_remove(self._keys(keys))]

    def remove_all(self, force: bool = False) -> int:
        """Remove every object of the pool, or with a tenant set only the tenant's; how many blocks that
        took from the pool (its count before less its count after: others' puts meanwhile count against
        it), or a negative status. The default tenant's is the whole pool's, other tenants' included
        (a difference from Mooncake, whose default tenant is one among others: here it has no namespace)."""
        return self._io.clear(self._prefix or None)

    # ----- lifecycle ----------------------------------------------------------------------------

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 pool unreachable or without workers (Mooncake's meanings)."""
        if self._io.closed:
            return 1
        return 0 if self._io.call(lambda c: c.stats().total.dram_capacity > 0, lambda st: False) else 2

    def get_hostname(self) -> str:
        return self._hostname

    def close(self) -> int:
        self._io.close()
        return 0


def _digest(prefix: str, name: str) -> str:
    """The pool's name of a key whose name `name` (with `prefix`) is too long: its SHA-256, marked."""
    return prefix + LONG_KEY_MARK + hashlib.sha256(name[len(prefix):].encode(errors="surrogatepass")).hexdigest()
