"""Tenants: tokens scoped to a key namespace, with a quota in bytes.

A worker may be given, besides its pool token (full access), a table of tenant tokens
(`WorkerConfig.tenants_file`, `--tenants FILE`, `KVPOOL_TENANTS_FILE`): JSON or TOML,
`{"<name>": {"token": "<secret>", "quota_bytes": <n>}}`, a 0600 file of the worker's user. A TCP
client authenticates with whichever token it holds (the ordinary challenge-response of
`kvpool.core.auth`: the worker checks the proof under each token it knows, so the client names no
tenant and a tenant token proves nothing under another tenant's); a connection that proved a tenant's
token is bound to the namespace `<name>/`:

- every key it names (put, get, exists, prefix, remove, pin) must start with `<name>/`: a request
  naming any other key is refused whole (`NamespaceError` for the caller, nothing done, counted in
  `kvpool_tenant_refusals_total{why="namespace"}` and logged once per connection); a pin, which has
  no reply, is dropped. Keys are not rewritten: a tenant's keys are the same bytes on the wire and in
  events.
- `clear()` clears only `<name>/`; a clear with a prefix outside it is refused.
- its bytes stored (each block once, whichever tiers hold it) may not exceed `quota_bytes`: a put
  that would is refused for that block (`QuotaExceeded`, a `CapacityError` with key and size;
  `why="quota"`); nothing of the tenant's is evicted to make room. Removing blocks frees quota; so do
  clears and the cache's own evictions and expiries. Blocks found on SSD at start count.

Not promised: the namespace binds TCP connections only. Same-node clients over the Unix socket and
shared memory are the worker's own Unix user (SO_PEERCRED) and have full access; any process of that
user can map the arena. Capacity is shared (a tenant's puts can evict others' blocks); quotas are
per worker. A tenant sees the worker's aggregate stats; block events carry every tenant's keys.
Quotas count bytes stored, not bandwidth or requests.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cache_events import CacheListener
from .errors import ConfigError
from .protocol import RESERVE_FLOOR

__all__ = ["Tenant", "TenantUsage", "load_tenants", "outside"]

log = logging.getLogger("kvpool.tenants")


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str
    quota_bytes: int | None = None
    """Bytes of blocks the tenant may hold in the worker (DRAM and SSD, each block once); None: no quota."""

    @property
    def prefix(self) -> bytes:
        return self.name.encode() + b"/"


def load_tenants(path: str | os.PathLike[str], pool_token: str | None = None) -> dict[str, Tenant]:
    """The tenant table in `path` (JSON, or TOML for a `.toml` name). The file must be this user's and
    readable by no one else (0600), as the token file; names are non-empty, without `/`; tokens at
    least 16 characters, distinct from each other and from the pool token."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"cannot read the tenants file {p}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(f"the tenants file {p} is owned by uid {st.st_uid} with mode "
                              f"{stat.S_IMODE(st.st_mode):o}; it must be this user's and 0600")
        raw = b""
        while chunk := os.read(fd, 1 << 16):
            raw += chunk
    finally:
        os.close(fd)
    try:
        table: Any
        if p.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib

                table = tomllib.loads(raw.decode())
            else:
                raise ConfigError(f"the tenants file {p}: TOML needs Python 3.11 or later; use JSON")
        else:
            table = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"the tenants file {p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from e
    if not isinstance(table, Mapping):
        raise ConfigError(f"the tenants file {p} must map tenant names to {{token, quota_bytes}}")
    tenants: dict[str, Tenant] = {}
    seen = {pool_token} if pool_token else set()
    for name, entry in table.items():
        if not isinstance(name, str) or not name or "/" in name or len(name.encode()) > 200:
            raise ConfigError(f"tenant name {name!r}: a non-empty name without '/' (its namespace is '<name>/')")
        if not isinstance(entry, Mapping) or not isinstance(entry.get("token"), str):
            raise ConfigError(f"tenant {name!r}: needs a string 'token'")
        token, quota = entry["token"], entry.get("quota_bytes")
        if len(token) < 16:
            raise ConfigError(f"tenant {name!r}: a token of {len(token)} characters; at least 16")
        if token in seen:
            raise ConfigError(f"tenant {name!r}: its token is the pool token's or another tenant's; each must differ")
        if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int) or quota < 0):
            raise ConfigError(f"tenant {name!r}: quota_bytes must be a non-negative integer, not {quota!r}")
        seen.add(token)
        tenants[name] = Tenant(name, token, quota)
    return tenants


def outside(tenant: Tenant, keys: Sequence[bytes | None]) -> bytes | None:
    """The first key of `keys` outside the tenant's namespace, if any."""
    pre = tenant.prefix
    for k in keys:
        if k is None or not k.startswith(pre) or len(k) == len(pre):
            return k if k is not None else b""
    return None


class TenantUsage(CacheListener):
    """Bytes each tenant holds in one worker's cache, kept from the cache's own events (so evictions,
    expiries and clears are counted however they happen), plus bytes of puts under way.

    A put first `charge`s its size (refused if used + pending + size would pass the quota), the worker
    then commits with `committing` set for its thread (the cache calls `stored` from the committing
    thread: that is how the block's size reaches the tally) and `settle`s the charge."""

    def __init__(self, tenants: Mapping[str, Tenant], ssd_size: Any = None) -> None:
        self._by_prefix = {t.prefix: t for t in tenants.values()}
        self._lock = threading.Lock()
        self._sizes: dict[bytes, tuple[str, int]] = {}  # key -> (tenant, size)
        self.used: dict[str, int] = dict.fromkeys(tenants, 0)
        self._pending: dict[str, int] = dict.fromkeys(tenants, 0)
        self._local = threading.local()
        self._ssd_size = ssd_size  # key -> size of an SSD block (for blocks found at start), or None

    def tenant_of(self, key: bytes) -> Tenant | None:
        slash = key.find(b"/")
        return self._by_prefix.get(key[:slash + 1]) if slash > 0 else None

    @staticmethod
    def cost(size: int) -> int:
        """What a block of `size` bytes counts against its tenant's quota: its size, and at least the
        smallest slot it takes (`RESERVE_FLOOR`): empty blocks would otherwise fill the arena (and the
        index) for free."""
        return max(size, RESERVE_FLOOR)

    def charge(self, tenant: Tenant, key: bytes, size: int) -> bool:
        """Reserve quota for a put of `size` bytes under `key` (replacing what `key` holds now): its
        `cost`, which the caller `settle`s once the put is done."""
        cost = self.cost(size)
        with self._lock:
            if tenant.quota_bytes is not None:
                held = self._sizes.get(key)
                replaced = held[1] if held else 0
                if self.used[tenant.name] + self._pending[tenant.name] - replaced + cost > tenant.quota_bytes:
                    return False
            self._pending[tenant.name] += cost
            return True

    def settle(self, tenant: Tenant, size: int) -> None:
        with self._lock:
            self._pending[tenant.name] -= size

    def committing(self, key: bytes | None, size: int = 0) -> None:
        """The block this thread is about to commit (None after): its size for `stored`."""
        self._local.block = {key: size} if key is not None else None

    def committing_many(self, sizes: dict[bytes, int] | None) -> None:
        """The blocks (key -> size) this thread is about to commit at once (None after), for `stored`."""
        self._local.block = sizes

    def usage(self, tenant: Tenant) -> dict[str, Any]:
        with self._lock:
            return {"tenant": tenant.name, "used_bytes": self.used[tenant.name], "quota_bytes": tenant.quota_bytes}

    # ----- CacheListener (called with the cache's lock held: quick, never raises) -----------------

    def stored(self, key: bytes, tier: str) -> None:
        t = self.tenant_of(key)
        if t is None:
            return
        block = getattr(self._local, "block", None)
        size = block.get(key) if block is not None else None
        if size is None:  # a block found at start (replay), or put by other means than the worker's handlers
            size = self._size_on_ssd(key) if tier == "ssd" else 0
        size = self.cost(size)
        with self._lock:
            old = self._sizes.get(key)
            if old is not None:
                self.used[old[0]] -= old[1]
            self._sizes[key] = (t.name, size)
            self.used[t.name] += size

    def removed(self, key: bytes, tier: str, reason: str) -> None:
        with self._lock:
            old = self._sizes.pop(key, None)
            if old is not None:
                self.used[old[0]] -= old[1]

    def cleared(self) -> None:
        with self._lock:
            self._sizes.clear()
            for name in self.used:
                self.used[name] = 0

    def _size_on_ssd(self, key: bytes) -> int:
        if self._ssd_size is None:
            return 0
        try:
            return int(self._ssd_size(key) or 0)
        except (KeyError, ValueError, TypeError) as e:
            log.warning("cannot size block %r for its tenant's quota: %s", key[:40], e)
            return 0
