"""What a worker answers: one handler per request of the wire protocol (`kvpool.core.protocol`).

- HELLO/AUTH: before authentication HELLO says only what a client needs to authenticate (that a
  token is required, and the worker's nonce); AUTH checks the client's proof, answers with the
  worker's own proof and then the worker's description (`kvpool.core.auth`).
- PUT/GET/EXISTS/PREFIX/REMOVE/CLEAR/STATS/PIN: the cache's operations, block bytes straight between
  the socket and arena slots, every block's checksum checked on arrival. PUT and GET work per batch:
  slots reserved, blocks committed, leased and released under one cache lock each; a PUT's small
  blocks received a group per system call and hashed while in cache.
- The same-node slot protocol ALLOC/COMMIT/ABORT/LEASE/RELEASE: a client on this node writes into
  slots it reserved and the worker verifies each block's checksum before it commits it. Each is
  handled per batch (one cache lock, columns built with numpy), not per key.
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, cast

import numpy as np

from . import protocol as P
from .auth import NONCE_BYTES, proof
from .errors import AuthError, ProtocolError, StorageError
from .fastcopy import hash_at
from .keys import MAX_KEY_BYTES
from .tenants import Tenant, TenantUsage, outside
from .tiers.dram_tier import block_columns
from .versions import capped, ceiling
from .worker_serving import Conn, ConnectionServing

_Columns = tuple[list[bytes], list[int], list[int], list[int], list[int], list[int]]
"""A COMMIT's keys, offsets, sizes, checksums, versions, and the indices of its corrupt blocks."""
_native_commit_columns: Callable[..., _Columns | None] | None
try:
    from ._native import commit_columns as _native_commit_columns
except ImportError:  # no C compiler when it was installed: the Python path of `RequestHandlers._commit_columns`
    _native_commit_columns = None

__all__ = ["RESERVE_SHARE", "RequestHandlers"]

log = logging.getLogger("kvpool.worker")


RESERVE_SHARE = 8
"""A same-node connection may hold at most 1/8 of the arena reserved and not yet committed."""


class RequestHandlers(ConnectionServing):
    """The request half of a `Worker`: `_handlers` maps each op to its method."""

    max_reserve: int
    tenants: dict[str, Tenant]
    tenant_usage: TenantUsage

    def info(self) -> dict[str, Any]:
        raise NotImplementedError

    def _init_handlers(self) -> None:
        self._handlers = {
            P.Op.HELLO: self._hello, P.Op.AUTH: self._auth, P.Op.PUT: self._put, P.Op.GET: self._get,
            P.Op.EXISTS: self._exists, P.Op.PREFIX: self._prefix, P.Op.REMOVE: self._remove,
            P.Op.SUPERSEDE: self._supersede,
            P.Op.CLEAR: self._clear, P.Op.STATS: self._stats, P.Op.ALLOC: self._alloc,
            P.Op.COMMIT: self._commit if self.config.check_puts == "commit" else self._commit_unchecked,
            P.Op.COMMIT_UNCHECKED: self._commit_unchecked, P.Op.ABORT: self._abort,
            P.Op.LEASE: self._lease,
            P.Op.RELEASE: self._release, P.Op.PIN: self._pin, P.Op.CHANGES: self._changes,
        }
        self._bytes_in, self._bytes_out = self.metrics.bytes.labels("in"), self.metrics.bytes.labels("out")

    # ----- authentication ---------------------------------------------------------------------

    def _hello(self, conn: Conn, frame: P.Frame) -> None:
        holder = P.unpack_json(frame.meta).get("holder", 0)
        if isinstance(holder, bool) or not isinstance(holder, int) or not 0 <= holder < 1 << 63:
            raise ProtocolError(f"HELLO with holder {holder!r:.40}: not an id of 63 bits")
        conn.holder = holder
        if conn.authed:
            self._reply(conn, frame, P.pack_json(self.info()))
        else:  # nothing about this worker before the peer proves it holds the token
            self._reply(conn, frame, P.pack_json({"auth": True, "nonce": self._challenge(conn).hex()}))

    def _auth(self, conn: Conn, frame: P.Frame) -> None:
        if conn.authed:
            raise ProtocolError("AUTH on an authenticated connection")
        meta = P.unpack_json(frame.meta)
        try:
            nonce_c = bytes.fromhex(str(meta.get("nonce", "")))
            shown = bytes.fromhex(str(meta.get("proof", "")))
        except ValueError:
            nonce_c, shown = b"", b""
        token, tenant = "", None
        if self.token and len(conn.nonce) == NONCE_BYTES and len(nonce_c) == NONCE_BYTES:
            # The pool token, else each tenant's: the proof says which the client holds (every one is
            # tried, so the time taken does not tell which matched).
            for name, candidate in [(None, self.token), *((t.name, t.token) for t in self.tenants.values())]:
                if hmac.compare_digest(shown, proof(candidate, conn.nonce, nonce_c, "client")) and not token:
                    token, tenant = candidate, name
        ok = bool(token)
        if not ok:
            why = "no HELLO before AUTH" if not conn.nonce else "a wrong or malformed proof"
            self.metrics.auth_failures.labels("token").inc()
            if conn.gone.wait(self.throttle.failed(conn.peer, why)):  # (a shut connection waits no longer)
                raise ConnectionError(f"connection from {conn.peer} shut while its failed AUTH was throttled")
            self._reply(conn, frame, P.pack_json({"error": "authentication failed"}), status=P.Status.AUTH_FAILED)
            raise AuthError(f"authentication failed from {conn.peer}: {why}")  # (closes it; logged by the throttle)
        self.throttle.succeeded(conn.peer)
        with self._conns_lock:  # (checked and taken at once: AUTHs at the same moment count each other)
            why = self._tenant_crowd(tenant) if tenant is not None else ""
            if not why:
                conn.tenant = self.tenants[tenant] if tenant is not None else None
                conn.authed = True
        if why:  # (not an AuthError: the token is good; to a cluster client this worker is busy, a miss)
            self._refused(conn.transport, "tenant_connections", why)
            self._reply(conn, frame, P.pack_json({"error": f"tenant {tenant}: {why}"}), status=P.Status.BUSY)
            raise ConnectionError(f"refused tenant {tenant}'s connection from {conn.peer}: {why}")
        conn.sock.settimeout(None)
        mine = proof(token, conn.nonce, nonce_c, "worker").hex()
        self._reply(conn, frame, P.pack_json({**self.info(), "proof": mine}))

    # ----- tenants ----------------------------------------------------------------------------

    def _tenant_crowd(self, tenant: str) -> str:
        """Why `tenant` may not have one more connection (empty if it may): each tenant holds at most an
        eighth of `max_connections`, all tenants together half, so that no tenant's idle connections
        shut out the others, nor the pool token's and same-node clients. `_conns_lock` held."""
        cap = self.config.max_connections
        held = [c.tenant.name for c in self._conns if c.authed and c.tenant is not None and not c.closing]
        if held.count(tenant) >= max(1, cap // 8):
            return f"this tenant holds {held.count(tenant)} connections, its most (max_connections / 8)"
        if len(held) >= max(1, cap // 2):
            return f"tenants hold {len(held)} connections, their most (max_connections / 2)"
        return ""

    def _named_keys(self, conn: Conn, frame: P.Frame) -> list[bytes] | None:
        """The keys a request names, or None when `conn` may not name one of them (refused, as
        `_in_namespace` says)."""
        keys, _ = P.unpack_batch(frame.meta)
        return keys if self._in_namespace(conn, frame, keys) else None

    def _in_namespace(self, conn: Conn, frame: P.Frame, keys: list[bytes], reply: bool = True) -> bool:
        """True if `conn` may name every one of `keys` (any key without a tenant). Otherwise the request
        is refused whole (FORBIDDEN: the client's NamespaceError), counted, and logged once per connection."""
        t = conn.tenant
        if t is None:
            return True
        bad = outside(t, keys)
        if bad is None:
            return True
        self._refuse_namespace(conn, frame, bad, reply)
        return False

    def _refuse_namespace(self, conn: Conn, frame: P.Frame, key: bytes, reply: bool = True) -> None:
        t = conn.tenant
        assert t is not None
        self.metrics.tenant_refusals.labels(t.name, "namespace").inc()
        shown = key[:64].decode(errors="replace")
        if not conn.refused_keys:
            log.warning("tenant %r from %s named key %r outside its namespace %r: request refused (counted in "
                        "kvpool_tenant_refusals_total; logged once per connection)", t.name, conn.peer, shown,
                        t.prefix.decode())
        conn.refused_keys += 1
        if reply:
            self._reply(conn, frame, P.pack_json({"error": f"key {shown!r} is outside this token's namespace "
                                                            f"{t.prefix.decode()!r}", "key": shown}),
                        status=P.Status.FORBIDDEN)

    # ----- blocks over the socket -------------------------------------------------------------

    def _put(self, conn: Conn, frame: P.Frame) -> None:
        # Per batch, not per block: quota charged, slots reserved under one lock, the blocks received a
        # group per system call and hashed while in cache, the good ones committed under one lock.
        keys, (sizes, csums, versions) = P.unpack_batch(frame.meta, "<i8", "<u8", "<u8")
        versions = capped(versions)
        lens = sizes.tolist()
        total = sum(lens)  # Python ints: an int64 sum of huge sizes could wrap to data_len
        if (sizes < 0).any() or total != frame.data_len:
            raise ProtocolError(f"PUT sizes sum to {total}; the frame carries {frame.data_len} bytes")
        tenant = conn.tenant
        if tenant is not None and (bad := outside(tenant, keys)) is not None:
            P.drain(conn.sock, frame.data_len)  # the request is read whole, then refused
            self._refuse_namespace(conn, frame, bad)
            return
        status = np.zeros(len(keys), dtype="<i1")
        costs = [0] * len(keys)  # what each block charged its tenant's quota, settled as its run commits
        settled = 0  # the blocks before this index are settled
        try:
            # A tenant's blocks are charged in order before any arrives (a refused one is read and dropped,
            # never given a slot). So within one batch a block found corrupt later still held its charge
            # when the blocks after it were charged, and a key named twice is charged twice: stricter than
            # the same puts one by one, never looser.
            if tenant is not None:
                usage = self.tenant_usage
                for i, (key, size) in enumerate(zip(keys, lens)):
                    if usage.charge(tenant, key, size):
                        costs[i] = usage.cost(size)
                    else:
                        status[i] = P.ITEM_QUOTA
                        self._over_quota(conn, tenant, key, size)
            max_block = self.cache.max_block
            status[(status == 0) & (sizes > max_block)] = P.ITEM_TOO_LARGE
            # Slots are reserved a run of blocks at a time, each run within what is left of the connection's
            # share of the arena (as ALLOC's): a frame's header alone must not hold the whole arena reserved
            # while its bytes are awaited (clients frame their puts to fit one run: `max_reserve`).
            for run in self._put_runs(conn, lens, status):
                want = [i for i in range(run.start, run.stop) if status[i] == 0]
                got = self.cache.reserve_many([lens[i] for i in want])  # None: no room for that block
                slots: list[int | None] = [None] * (run.stop - run.start)
                for i, off in zip(want, got):
                    if off is None:
                        status[i] = P.ITEM_FULL
                    slots[i - run.start] = off
                try:
                    self._recv_and_commit(conn, keys[run], lens[run], csums[run], versions[run], slots, status[run])
                except StorageError as e:  # committed, but a full disk kept older SSD copies: not durable
                    self._storage_refused(e)
                    run_status = status[run]
                    run_status[run_status == 0] = P.ITEM_STORAGE
                if tenant is not None:  # committed: the run's blocks count as used now, no longer pending
                    self.tenant_usage.settle(tenant, sum(costs[run]))
                settled = run.stop
        finally:
            if tenant is not None and (rest := sum(costs[settled:])):
                self.tenant_usage.settle(tenant, rest)
        self._bytes_in.inc(frame.data_len)
        self._reply(conn, frame, status.tobytes())

    def _put_runs(self, conn: Conn, lens: list[int], status: np.ndarray) -> list[slice]:
        """A PUT's blocks in consecutive runs, each reserving at most what is left of the connection's
        share (`max_reserve` less its ALLOCs' slots; a block's size and RESERVE_FLOOR, for each block to
        be stored: `status` 0). A block that would not fit even alone is ITEM_FULL, as ALLOC's."""
        floor = P.RESERVE_FLOOR
        budget = self.max_reserve - sum(conn.reserved.values()) - floor * len(conn.reserved)
        runs: list[slice] = []
        start, held = 0, 0
        for i, size in enumerate(lens):
            if status[i] != 0:
                continue
            if size + floor > budget:
                status[i] = P.ITEM_FULL
                continue
            if held + size + floor > budget:
                runs.append(slice(start, i))
                start, held = i, 0
            held += size + floor
        runs.append(slice(start, len(lens)))
        return runs

    def _recv_and_commit(self, conn: Conn, keys: list[bytes], lens: list[int], csums: np.ndarray,
                         versions: np.ndarray, slots: list[int | None], status: np.ndarray) -> None:
        """Receive a PUT's blocks, each into its slot (None: read and dropped), check their checksums and
        commit the good ones; `status` gets ITEM_CORRUPT for each that fails. Every slot is either
        committed or given back, whatever happens."""
        arena = self.cache.arena
        parts = [size if off is None else arena.view(off, size) for off, size in zip(slots, lens)]
        try:
            sums = P.recv_blocks(conn.sock, parts)
        except BaseException:
            for off in slots:
                if off is not None:
                    self.cache.abort(off)
            raise
        if None not in slots and sums == csums.tolist():  # the usual batch: a slot each, every block whole
            self._commit_marked(status, np.arange(len(keys)), keys, cast("list[int]", slots), lens,
                                cast("list[int]", sums), versions.tolist())
            return
        held = [(i, off) for i, off in enumerate(slots) if off is not None]
        if not held:
            return
        idx = np.fromiter((i for i, _ in held), dtype=np.intp, count=len(held))
        offs = np.fromiter((off for _, off in held), dtype="<i8", count=len(held))
        corrupt = np.fromiter((sums[i] for i, _ in held), dtype="<u8", count=len(held)) != csums[idx]
        if corrupt.any():
            for off in offs[corrupt].tolist():
                self.cache.abort(off)
            self.metrics.corrupt_blocks.inc(int(corrupt.sum()))
            status[idx[corrupt]] = P.ITEM_CORRUPT
            idx, offs = idx[~corrupt], offs[~corrupt]
        # a pin sent before the block pins it; one no newer than what is held is not stored
        self._commit_marked(status, idx, [keys[i] for i in idx.tolist()], offs.tolist(), np.take(lens, idx).tolist(),
                            csums[idx].tolist(), versions[idx].tolist())

    def _commit_marked(self, status: np.ndarray, at: np.ndarray | None, keys: list[bytes], offsets: list[int],
                       sizes: list[int], csums: list[int], versions: list[int], checked: bool = True) -> None:
        """`_commit_blocks`, each block not stored (a version as new or newer held) marked ITEM_SUPERSEDED
        at its index in `status` (`at`; None: the blocks are `status`'s, in order), also where the disk
        refuses to make the batch durable (the StorageError is raised after: the caller marks the rest
        ITEM_STORAGE)."""
        try:
            stored = self._commit_blocks(keys, offsets, sizes, csums, versions, checked)
        except StorageError as e:
            if e.stored is not None:
                lost = ~np.array(e.stored, dtype=bool)
                status[lost if at is None else at[lost]] = P.ITEM_SUPERSEDED
            raise
        if not stored.all():
            status[~stored if at is None else at[~stored]] = P.ITEM_SUPERSEDED

    def _commit_blocks(self, keys: list[bytes], offsets: list[int], sizes: list[int], csums: list[int],
                       versions: list[int], checked: bool = True) -> np.ndarray:
        """Commit blocks under one lock (`TieredCache.commit_many`; `checked`: their bytes were hashed
        against `csums`), each block's size told to the tenants' tally; whether each was stored (not:
        a version as new or newer is held). A key named twice is committed in turns, so the tally sees
        each block's own size. A StorageError (not durable) is raised once every block is committed,
        with whether each was stored."""
        if not self.tenants:
            return np.array(self.cache.commit_many(keys, offsets, sizes, csums, versions, checked=checked), dtype=bool)
        usage = self.tenant_usage
        runs = [slice(0, len(keys))] if len(set(keys)) == len(keys) else [slice(i, i + 1) for i in range(len(keys))]
        stored: list[bool] = []
        refused: StorageError | None = None
        for r in runs:
            usage.committing_many(dict(zip(keys[r], sizes[r])))
            try:
                stored += self.cache.commit_many(keys[r], offsets[r], sizes[r], csums[r], versions[r], checked=checked)
            except StorageError as e:
                refused = refused or e
                stored += e.stored if e.stored is not None else [True] * (r.stop - r.start)
            finally:
                usage.committing_many(None)
        if refused is not None:
            refused.stored = stored
            raise refused
        return np.array(stored, dtype=bool)

    def _over_quota(self, conn: Conn, tenant: Tenant, key: bytes, size: int) -> None:
        self.metrics.tenant_refusals.labels(tenant.name, "quota").inc()
        if not conn.over_quota:
            conn.over_quota = True
            log.warning("tenant %r from %s: a put of %d bytes under %r would pass its quota of %s bytes "
                        "(%s used): refused (counted in kvpool_tenant_refusals_total; logged once per connection)",
                        tenant.name, conn.peer, size, key[:64].decode(errors="replace"), tenant.quota_bytes,
                        self.tenant_usage.usage(tenant)["used_bytes"])

    def _get(self, conn: Conn, frame: P.Frame) -> None:
        keys = self._named_keys(conn, frame)
        if keys is None:
            return
        blocks = self.cache.acquire_many(keys)  # one lock for the batch's DRAM hits
        try:
            held = [b for b in blocks if b is not None]
            count = len(held)
            columns = block_columns(held)  # offsets, sizes, checksums, versions
            offsets, sizes = (np.frombuffer(columns, dtype="<i8", count=count, offset=8 * count * j) for j in (0, 1))
            total = int(sizes.sum())
            if total > P.MAX_DATA:  # no peer takes such a frame: refused whole (the client splits by its buffers)
                self._reply(conn, frame, P.pack_json({"error": f"GET of {total} bytes: a reply holds at most "
                                                               f"{P.MAX_DATA}; ask in smaller batches"}),
                            status=P.Status.ERROR)
                return
            view = self.cache.arena.view
            data = list(map(view, offsets.tolist(), sizes.tolist()))
            self._bytes_out.inc(total)
            if count == len(keys):  # every key a hit (the usual batch): sizes, checksums, versions as they are
                meta = columns[8 * count:]
            else:  # misses: size ITEM_MISS, checksum 0, the version of the key's removal
                csums = np.frombuffer(columns, dtype="<u8", count=count, offset=16 * count)
                hit = np.fromiter((b is not None for b in blocks), dtype=bool, count=len(keys))
                meta = (_scatter(sizes, hit, P.ITEM_MISS).tobytes() + _scatter(csums, hit, 0).tobytes()
                        + _versions(self.cache, keys, blocks).tobytes())
            self._reply(conn, frame, meta, data)
            del data
        finally:
            self.cache.release_many([b for b in blocks if b is not None])

    # ----- control ----------------------------------------------------------------------------

    def _exists(self, conn: Conn, frame: P.Frame) -> None:
        keys = self._named_keys(conn, frame)
        if keys is None:
            return
        flags, versions = self.cache.replicas.batch_versions(keys)
        self._reply(conn, frame, _flags(flags) + np.array(versions, dtype="<u8").tobytes())

    def _prefix(self, conn: Conn, frame: P.Frame) -> None:
        keys = self._named_keys(conn, frame)
        if keys is None:
            return
        self._reply(conn, frame, P.pack_json({"n": self.cache.prefix_match(keys)}))

    def _remove(self, conn: Conn, frame: P.Frame) -> None:
        keys, (versions,) = P.unpack_batch(frame.meta, "<u8")
        versions = capped(versions)
        if not self._in_namespace(conn, frame, keys):
            return
        self._reply(conn, frame, _flags(self.cache.remove_as_of(keys, versions.tolist())))

    def _supersede(self, conn: Conn, frame: P.Frame) -> None:
        keys, (versions,) = P.unpack_batch(frame.meta, "<u8")
        versions = capped(versions)
        if not self._in_namespace(conn, frame, keys, reply=False):  # no reply: refused, logged
            return
        self.cache.replicas.supersede(keys, versions.tolist())

    def _changes(self, conn: Conn, frame: P.Frame) -> None:
        """The changes this worker accepted since a time, for a peer catching up (`kvpool.core.catch_up`)."""
        if conn.tenant is not None:  # a peer worker holds the pool token, never a tenant's
            self._refuse_namespace(conn, frame, b"")
            return
        ask = P.unpack_json(frame.meta)
        since_ms, from_seq = ask.get("since_ms", 0), ask.get("from_seq", 0)
        if not isinstance(since_ms, int) or not isinstance(from_seq, int):
            raise ProtocolError(f"CHANGES asks {ask!r}; since_ms and from_seq are integers")
        changes, nxt, covered = self.cache.replicas.changes_since(since_ms, from_seq)
        head = np.array([covered], dtype="<u8").tobytes() + np.array([nxt], dtype="<i8").tobytes()
        self._reply(conn, frame, head + P.pack_changes(changes))

    def _clear(self, conn: Conn, frame: P.Frame) -> None:
        prefix = P.unpack_batch(frame.meta)[0] if frame.meta else [None]
        if len(prefix) != 1:
            raise ProtocolError(f"CLEAR names {len(prefix)} prefixes; at most one")
        tenant = conn.tenant
        if tenant is not None:  # a tenant clears its own namespace, or a part of it
            if prefix[0] is None:
                prefix = [tenant.prefix]
            elif not prefix[0].startswith(tenant.prefix):
                self._refuse_namespace(conn, frame, prefix[0])
                return
        self.cache.clear(prefix[0])
        self._reply(conn, frame)

    def _stats(self, conn: Conn, frame: P.Frame) -> None:
        extra = {"tenant": self.tenant_usage.usage(conn.tenant)} if conn.tenant is not None else {}
        self._reply(conn, frame, P.pack_json({**self.info(), "stats": self.cache.stats().as_dict(), **extra}))

    def _pin(self, conn: Conn, frame: P.Frame) -> None:
        keys, (seconds,) = P.unpack_batch(frame.meta, "<f8")
        if not np.isfinite(seconds).all():  # a NaN deadline never passes and holds back every other pin's
            raise ProtocolError("PIN of a duration that is not a finite number of seconds")
        if not self._in_namespace(conn, frame, keys, reply=False):  # PIN has no reply: refused, logged
            return
        groups: dict[float, list[bytes]] = {}
        for k, s in zip(keys, seconds.tolist()):  # clients send one duration per frame: one call each
            groups.setdefault(s, []).append(k)
        for s, ks in groups.items():
            self.cache.batch_pin(ks, s, conn.holder)

    # ----- same-node slot protocol ------------------------------------------------------------

    def _alloc(self, conn: Conn, frame: P.Frame) -> None:
        keys, (sizes,) = P.unpack_batch(frame.meta, "<i8")
        if not self._in_namespace(conn, frame, keys):  # same-node peers have no tenant today; kept in step
            return
        max_block = self.cache.max_block
        # each block charged RESERVE_FLOOR beyond its size, as clients frame their puts (a budget of sizes
        # alone let 0-byte blocks reserve the whole arena)
        extra = P.RESERVE_FLOOR
        budget = self.max_reserve - sum(conn.reserved.values()) - extra * len(conn.reserved)
        lens = sizes.tolist()
        too_large: list[int] = []
        want: list[int] | None = None  # None: every block (in range, and within the budget: the usual batch)
        if not (lens and min(lens) >= 0 and max(lens) <= max_block and sum(lens) + extra * len(lens) <= budget):
            want = []
            for i, size in enumerate(lens):
                if size > max_block or size < 0:
                    too_large.append(i)
                elif size + extra <= budget:  # else ITEM_FULL: this connection holds its share uncommitted
                    want.append(i)
                    budget -= size + extra
        wanted = lens if want is None else [lens[i] for i in want]
        got = self.cache.reserve_many(wanted)  # one lock for the batch; None: no room for that block
        if want is None and None not in got:  # a slot for each
            conn.reserved.update(zip(cast("list[int]", got), lens))
            self._reply(conn, frame, np.array(got, dtype="<i8").tobytes())
            return
        conn.reserved.update((off, size) for off, size in zip(got, wanted) if off is not None)
        offsets = np.full(len(keys), P.ITEM_FULL, dtype="<i8")
        offsets[range(len(lens)) if want is None else want] = [P.ITEM_FULL if off is None else off for off in got]
        offsets[too_large] = P.ITEM_TOO_LARGE
        self._reply(conn, frame, offsets.tobytes())

    def _commit(self, conn: Conn, frame: P.Frame, check: bool = True) -> None:
        # A same-node writer copies into the arena itself and sends the checksum of what it wrote; the
        # worker hashes the slot again before it commits, so a block whose bytes do not match what its
        # writer claims is refused (ITEM_CORRUPT: the client's CorruptBlock), never served as a hit.
        # The batch is checked whole (slots, then checksums), then committed under one lock.
        # COMMIT_UNCHECKED (`check` False) commits at once; the cache hashes each block at its first
        # read instead (a miss if it fails), so a block nobody reads through the worker (a handoff's
        # layer, which its reader copies in place and checks itself) is never hashed here.
        keys, offs, lens, csums, versions, corrupt = self._commit_columns(conn, frame, check)
        status = np.zeros(len(keys), dtype="<i1")
        at = None  # (the blocks committed are the batch's, in order)
        if corrupt:
            for i in corrupt:
                self.cache.abort(offs[i])
            self.metrics.corrupt_blocks.inc(len(corrupt))
            status[corrupt] = P.ITEM_CORRUPT
            bad = set(corrupt)
            good = [i for i in range(len(keys)) if i not in bad]
            keys = [keys[i] for i in good]
            offs, lens, csums, versions = ([col[i] for i in good] for col in (offs, lens, csums, versions))
            at = np.array(good, dtype=np.intp)
        try:
            self._commit_marked(status, at, keys, offs, lens, csums, versions, check)
        except StorageError as e:  # committed, but a full disk kept older SSD copies: not durable
            self._storage_refused(e)
            status[status == 0] = P.ITEM_STORAGE
        self._bytes_in.inc(sum(lens))
        self._reply(conn, frame, status.tobytes())

    def _commit_columns(self, conn: Conn, frame: P.Frame, check: bool) -> _Columns:
        """A COMMIT's keys, offsets, sizes, checksums and versions (capped: `versions.capped`), its slots
        taken from those the connection reserved, and (`check`) the indices of the blocks whose bytes
        disagree with their checksums: in one C call (`_native.commit_columns`) where the extension was
        built and the request is well formed; ProtocolError for a request that is not."""
        arena = self.cache.arena
        if _native_commit_columns is not None:
            got = _native_commit_columns(frame.meta, P.MAX_BATCH, MAX_KEY_BYTES, ceiling(), conn.reserved, arena.buf,
                                         check)
            if got is not None:
                return got
        keys, (offsets, sizes, csums, versions) = P.unpack_batch(frame.meta, "<i8", "<i8", "<u8", "<u8")
        versions = capped(versions)
        offs, lens = offsets.tolist(), sizes.tolist()
        reserved = conn.reserved
        claimed = list(map(reserved.pop, offs, repeat(None)))
        if claimed != lens:  # a slot not reserved by this connection, of another size, or named twice
            for off, size in zip(offs, claimed):
                if size is not None:
                    reserved[off] = size  # given back when the connection closes
            off, size = next((o, n) for o, n, c in zip(offs, lens, claimed) if c != n)
            raise ProtocolError(f"COMMIT of offset {off} ({size} bytes) that this connection did not reserve")
        corrupt = np.flatnonzero(hash_at(arena.buf, offsets, sizes) != csums).tolist() if check else []
        return keys, offs, lens, csums.tolist(), versions.tolist(), corrupt

    def _commit_unchecked(self, conn: Conn, frame: P.Frame) -> None:
        self._commit(conn, frame, check=False)

    def _abort(self, conn: Conn, frame: P.Frame) -> None:
        for off in P.unpack_ids(frame.meta).tolist():
            if conn.reserved.pop(off, None) is not None:
                self.cache.abort(off)

    def _lease(self, conn: Conn, frame: P.Frame) -> None:
        keys = self._named_keys(conn, frame)
        if keys is None:
            return
        n = len(keys)
        if len(conn.leases) + n > P.MAX_LEASES:
            why = f"LEASE of {n} blocks on a connection holding {len(conn.leases)}: at most {P.MAX_LEASES} at once"
            self._reply(conn, frame, P.pack_json({"error": why + " (release them first)"}), status=P.Status.ERROR)
            return
        blocks = self.cache.acquire_many(keys)  # one lock for the batch's DRAM hits
        held = [b for b in blocks if b is not None]
        first, count = conn.next_lease, len(held)
        conn.next_lease += count
        conn.leases.update(zip(range(first, first + count), held))
        ids = np.arange(first, first + count, dtype="<i8")
        columns = block_columns(held)  # offsets, sizes, checksums, versions
        sizes = np.frombuffer(columns, dtype="<i8", count=count, offset=8 * count)
        self._bytes_out.inc(int(sizes.sum()))
        if count == n:  # every key a hit (the usual batch)
            self._reply(conn, frame, ids.tobytes() + columns)
            return
        # misses: lease id 0, offset and size ITEM_MISS, checksum 0, the version of the key's removal
        offsets = np.frombuffer(columns, dtype="<i8", count=count)
        csums = np.frombuffer(columns, dtype="<u8", count=count, offset=16 * count)
        hit = np.fromiter((b is not None for b in blocks), dtype=bool, count=n)
        ids, offsets, sizes, csums = (_scatter(col, hit, fill) for col, fill in
                                      ((ids, 0), (offsets, P.ITEM_MISS), (sizes, P.ITEM_MISS), (csums, 0)))
        self._reply(conn, frame, ids.tobytes() + offsets.tobytes() + sizes.tobytes() + csums.tobytes()
                    + _versions(self.cache, keys, blocks).tobytes())

    def _release(self, conn: Conn, frame: P.Frame) -> None:
        ended = map(conn.leases.pop, P.unpack_ids(frame.meta).tolist(), repeat(None))
        self.cache.release_many([b for b in ended if b is not None])


def _scatter(values: np.ndarray, where: np.ndarray, fill: int) -> np.ndarray:
    """An array as long as `where` with `values` where it is True, `fill` elsewhere."""
    out = np.full(where.size, fill, dtype=values.dtype)
    out[where] = values
    return out


def _versions(cache: Any, keys: list[bytes], blocks: list[Any]) -> np.ndarray:
    """Each block's version; for each miss, its key's tombstone's (0 if none)."""
    versions = np.array([b.version if b is not None else 0 for b in blocks], dtype="<u8")
    missed = [i for i, b in enumerate(blocks) if b is None]
    if missed:
        versions[missed] = cache.replicas.removed_versions([keys[i] for i in missed])
    return versions


def _flags(values: Sequence[int]) -> bytes:
    """A reply of one byte per key (EXISTS: present or not; REMOVE: its outcome)."""
    return np.array(values, dtype="<u1").tobytes()
