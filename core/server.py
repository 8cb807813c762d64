"""The node worker: serves its TieredCache over TCP (any node) and a Unix socket (same node).

One thread per connection, blocking sockets: block bytes go from the socket straight into arena slots
and from arena slots straight to the socket. Same-node clients map the arena and exchange only small
control messages (alloc/commit, lease/release); a connection that closes gives back its reservations
and leases. A malformed frame closes that connection only, with a logged reason.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from . import protocol as P
from .cache import BlockRef, TieredCache
from .config import CacheConfig, WorkerConfig, default_node_id, default_state_dir
from .errors import BlockTooLarge, CapacityError, ConfigError, KVPoolError, ListenError, ProtocolError
from .metrics import WorkerMetrics

log = logging.getLogger("kvpool.worker")

_SCRATCH = 1 << 20
_SOCK_BUF = 8 << 20  # room for the sender to run ahead while a received chunk is hashed


_LOCAL_ONLY = {"127.0.0.1", "::1", "localhost"}


def _unix_listener(path: str) -> socket.socket:
    """A listening Unix socket at `path`, created 0600: only this user's processes connect."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on the Unix socket {path}: {e.strerror or e}") from e
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock


def _id_file(cache: CacheConfig, port: int) -> Path:
    """Where a worker keeps its id: beside its SSD tier (the id follows the blocks), else in the state
    dir per port."""
    if cache.ssd_path:
        return Path(cache.ssd_path) / "kvpool-worker-id"
    return default_state_dir() / f"worker-{port}.id"


def stored_worker_id(path: Path) -> str:
    """The id saved at `path`, or a new random one saved there: a restart on the same state keeps its
    id, so placement sends it the keys its SSD tier holds."""
    try:
        wid = path.read_text().strip()
        if wid:
            return wid
    except FileNotFoundError:
        pass
    wid = secrets.token_hex(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(wid + "\n")
    os.replace(tmp, path)
    return wid


def is_local_only(host: str) -> bool:
    """Binds that no other machine (or other loopback address) can reach without a token."""
    return host in _LOCAL_ONLY


class _Conn:
    """State of one client connection."""

    def __init__(self, sock: socket.socket, transport: str, authed: bool) -> None:
        self.sock = sock
        self.transport = transport
        self.authed = authed
        self.since = time.monotonic()
        self.request_since = 0.0  # monotonic time of the current request's first byte; 0 between requests
        self.closing = ""  # why the watchdog shut the connection down
        self.busy = False
        self.reserved: dict[int, int] = {}  # offset -> size
        self.leases: dict[int, BlockRef] = {}  # lease id -> block
        self.next_lease = 1


class Worker:
    """A kvpool worker. `start()` binds and serves in background threads; `stop()` drains and flushes."""

    def __init__(self, config: WorkerConfig | None = None, cache: CacheConfig | None = None) -> None:
        from .config import load

        self.config = cfg = config if config is not None else load(WorkerConfig)
        if not is_local_only(cfg.host) and not cfg.token:
            raise ConfigError(f"binding {cfg.host} (not 127.0.0.1) needs a token: set KVPOOL_TOKEN or --token")
        if cfg.host in ("0.0.0.0", "::", "") and not cfg.advertise_host and cfg.nats_url:
            raise ConfigError(f"binding the wildcard {cfg.host!r} in a cluster needs --advertise-host (the address "
                              "other machines reach this worker at); a wildcard is no address to advertise")
        cache_cfg = cache if cache is not None else load(CacheConfig)
        self.node_id = cfg.node_id or default_node_id()
        self._stopping = threading.Event()
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._accept_errors: dict[str, str] = {}  # transport -> the error last logged
        self._refusing: set[str] = set()  # connection limits already logged as reached
        self.membership: Any = None
        self.events: Any = None  # block-event publishing (--events, --events-zmq), from start() to stop()
        # Sockets first: a port in use must fail before a pre-faulted arena of many GiB exists.
        try:
            self._tcp = socket.create_server((cfg.host, cfg.port), backlog=128, reuse_port=False)
        except OSError as e:
            raise ListenError(f"cannot listen on tcp {cfg.host}:{cfg.port}: {e.strerror or e}") from e
        try:
            self.port = self._tcp.getsockname()[1]
            self.unix_path = cfg.unix_path or str(default_state_dir() / f"worker-{self.port}.sock")
            self._unix = _unix_listener(self.unix_path)
        except BaseException:
            self._tcp.close()
            raise
        try:
            self.worker_id = cfg.worker_id or stored_worker_id(_id_file(cache_cfg, self.port))
            self.cache = TieredCache(cache_cfg, share_arena=True)
        except BaseException:
            self._close_listeners()
            raise
        self.max_reserve = max(self.cache.max_block, self.cache.arena.size // _RESERVE_SHARE)
        """Bytes one same-node connection may hold allocated but not committed: a client that stalls
        between ALLOC and COMMIT (it writes the arena itself, so its slots cannot be taken back while
        it lives) blocks at most this much of the arena."""
        self.metrics = WorkerMetrics(lambda: self.cache.stats().as_dict())
        self._handlers: dict[int, Callable[[_Conn, P.Frame], None]] = {
            P.Op.HELLO: self._hello, P.Op.AUTH: self._auth, P.Op.PUT: self._put, P.Op.GET: self._get,
            P.Op.EXISTS: self._exists, P.Op.PREFIX: self._prefix, P.Op.REMOVE: self._remove,
            P.Op.CLEAR: self._clear, P.Op.STATS: self._stats, P.Op.ALLOC: self._alloc,
            P.Op.COMMIT: self._commit, P.Op.ABORT: self._abort, P.Op.LEASE: self._lease,
            P.Op.RELEASE: self._release, P.Op.PIN: self._pin,
        }

    # ----- lifecycle --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.config.advertise_host or self.config.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        """What the worker registers in the cluster and answers to HELLO."""
        s = self.cache.stats()
        return {"worker_id": self.worker_id, "node_id": self.node_id, "tcp": self.address,
                "unix": self.unix_path, "arena": self.cache.arena.name, "arena_size": self.cache.arena.size,
                "dram_capacity": s.dram_capacity, "dram_bytes": s.dram_bytes,
                "ssd_bytes": s.ssd_bytes, "hits": s.hits_dram + s.hits_ssd + s.hits_device,
                "misses": s.misses, "max_block": self.cache.max_block, "max_reserve": self.max_reserve,
                "transports": ["tcp", "shm"],
                "auth": bool(self.config.token), "pid": os.getpid()}

    def start(self) -> Worker:
        """Serve in background threads and join the cluster. If any of it fails (metrics port in use,
        NATS unreachable), everything the worker holds is released, its arena first, and the error raised."""
        try:
            if self.config.metrics_port is not None:
                self.metrics.serve(self.config.host, self.config.metrics_port)
            if self.config.nats_url:
                from .cluster import Membership

                self.membership = Membership(self.config.nats_url, self.config.member_ttl_s,
                                             replicas=self.config.nats_replicas)
                self.membership.register(self.worker_id, self.info, self.config.heartbeat_s,
                                         on_rejoin=self._left_cluster)
            if self.config.events or self.config.events_zmq:
                from .worker_events import WorkerEvents

                self.events = WorkerEvents(self)
        except BaseException:
            self._stopping.set()
            if self.membership is not None:
                self.membership.close()
            self._close_listeners()
            self.cache.close()
            raise
        for lsock, transport in ((self._tcp, "tcp"), (self._unix, "shm")):
            t = threading.Thread(target=self._accept_loop, args=(lsock, transport), daemon=True,
                                 name=f"kvpool-accept-{transport}")
            t.start()
        threading.Thread(target=self._watchdog, daemon=True, name="kvpool-watchdog").start()
        log.info("worker %s serving tcp %s and %s (arena %s, %d bytes)", self.worker_id, self.address,
                 self.unix_path, self.cache.arena.name, self.cache.arena.size)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish, flush DRAM to SSD, leave the cluster."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.membership is not None:
            self.membership.close()
        self._close_listeners()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._conns_lock:
                idle = [c for c in self._conns if not c.busy]
                busy = len(self._conns) - len(idle)
            for c in idle:
                _shutdown(c.sock)
            if not busy and not idle:
                break
            time.sleep(0.01)
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        self.cache.flush()
        self.cache.close()
        if self.events is not None:
            self.events.close()  # after the flush: its last tier moves are published too
        log.info("worker %s stopped", self.worker_id)

    def _left_cluster(self, gap_s: float) -> None:
        """Heartbeats lapsed past the member TTL: clients dropped this worker and write its keys to
        others, so its blocks may turn stale. It drops them (misses cost a recompute; a stale hit would
        cost a wrong answer) and comes back empty."""
        log.warning("worker %s: no heartbeat got through for %.1f s (member TTL %.1f s): dropping its blocks, "
                    "which clients may overwrite elsewhere meanwhile", self.worker_id, gap_s, self.config.member_ttl_s)
        self.cache.clear()

    def _close_listeners(self) -> None:
        self._tcp.close()
        self._unix.close()
        try:
            os.unlink(self.unix_path)
        except FileNotFoundError:
            pass

    def _accept_loop(self, lsock: socket.socket, transport: str) -> None:
        """Accept until stop(). An accept error (EMFILE, ENFILE, ENOBUFS, ...) never ends the loop while
        the worker is listed: it is counted, logged once per change, and retried after a back-off."""
        backoff = 0.0
        while not self._stopping.is_set():
            try:
                sock, _ = lsock.accept()
            except OSError as e:
                if self._stopping.is_set():
                    return
                backoff = min(1.0, backoff * 2 or 0.01)
                self._accept_failed(transport, e)
                self._stopping.wait(backoff)
                continue
            if backoff:
                backoff = 0.0
                log.info("accepting %s connections again", transport)
                self._accept_errors.pop(transport, None)
            authed = transport == "shm" or not self.config.token
            with self._conns_lock:
                full = len(self._conns) >= self.config.max_connections
                waiting = [c for c in self._conns if not c.authed and not c.closing]
            if full:
                self._refused(transport, "max_connections")
                sock.close()
                continue
            if not authed and len(waiting) >= self.config.max_unauthenticated:
                # The oldest stranger makes room: a client with the token authenticates within a round
                # trip and so outlives any crowd of strangers, who only ever displace each other.
                oldest = min(waiting, key=lambda c: c.since)
                oldest.closing = "displaced by a newer unauthenticated connection (max_unauthenticated)"
                self._refused(transport, "max_unauthenticated")
                _shutdown(oldest.sock)
            if transport == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
            io_timeout = struct.pack("ll", int(self.config.io_timeout_s), int(self.config.io_timeout_s % 1 * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, io_timeout)  # see _next_frame
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, io_timeout)
            conn = _Conn(sock, transport, authed)
            if not conn.authed:
                sock.settimeout(self.config.auth_timeout_s)  # lifted by a good AUTH; the watchdog bounds the rest
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="kvpool-conn")
            with self._conns_lock:
                self._conns.add(conn)
                self._threads.append(t)
            t.start()

    def _refused(self, transport: str, limit: str) -> None:
        """Count (and log the first time) a connection closed because `limit` was reached."""
        self.metrics.refused.labels(limit).inc()
        if limit not in self._refusing:
            self._refusing.add(limit)
            log.warning("%s connections: %s (%d) reached; connections are closed (counted in "
                        "kvpool_refused_connections_total; logged once)", transport, limit, getattr(self.config, limit))

    def _watchdog(self) -> None:
        """Enforce the deadlines that span system calls: a request must be received and answered within
        io_timeout_s of its first byte, a TCP peer with a token to present must authenticate within
        auth_timeout_s of connecting. A late connection is shut down, which wakes its thread out of
        any blocked receive or send; that thread then frees what the connection held."""
        cfg = self.config
        every = max(0.05, min(cfg.io_timeout_s, cfg.auth_timeout_s) / 10)
        while not self._stopping.wait(every):
            now = time.monotonic()
            with self._conns_lock:
                conns = list(self._conns)
            for c in conns:
                if c.closing:
                    continue
                if not c.authed and now - c.since > cfg.auth_timeout_s:
                    c.closing = f"not authenticated within auth_timeout_s ({cfg.auth_timeout_s} s)"
                elif c.request_since and now - c.request_since > cfg.io_timeout_s:
                    c.closing = f"a request not done within io_timeout_s ({cfg.io_timeout_s} s)"
                else:
                    continue
                self.metrics.deadline_closes.labels("auth" if not c.authed else "io").inc()
                _shutdown(c.sock)

    def _accept_failed(self, transport: str, err: OSError) -> None:
        self.metrics.accept_errors.labels(transport).inc()
        why = f"{type(err).__name__}: {err}"
        if self._accept_errors.get(transport) != why:
            self._accept_errors[transport] = why
            log.warning("cannot accept %s connections (%s); retrying with back-off", transport, why)

    def _serve(self, conn: _Conn) -> None:
        self.metrics.connections.labels(conn.transport).inc()
        try:
            while not self._stopping.is_set():
                frame = self._next_frame(conn)  # sets conn.request_since at the request's first byte
                conn.busy = True
                t0 = time.perf_counter()
                self._dispatch(conn, frame)
                op = P.Op(frame.op).name.lower()
                self.metrics.ops.labels(op).inc()
                self.metrics.latency.labels(op).observe(time.perf_counter() - t0)
                conn.busy = False
                conn.request_since = 0.0
        except ProtocolError as e:
            self.metrics.protocol_errors.inc()
            log.warning("closing %s connection: %s", conn.transport, e)
        except KVPoolError as e:  # e.g. a full disk under REMOVE or CLEAR, or the cache closing under us
            log.warning("closing %s connection: %s: %s", conn.transport, type(e).__name__, e)
        except (ConnectionError, OSError):
            if conn.closing:  # the watchdog's doing, not the client's
                log.warning("closed a %s connection: %s", conn.transport, conn.closing)
        finally:
            conn.busy = False
            self._cleanup(conn)
            self.metrics.connections.labels(conn.transport).dec()

    def _next_frame(self, conn: _Conn) -> P.Frame:
        """Wait for the next request for as long as the client idles; from its first byte on, every
        receive and send of the exchange must progress within io_timeout_s (the socket's SO_RCVTIMEO
        and SO_SNDTIMEO) or the connection is dropped, so a stalled peer cannot hold slots or leases."""
        while True:
            try:
                if not conn.sock.recv(1, socket.MSG_PEEK):
                    raise ConnectionError("closed by the client")
                break
            except BlockingIOError:  # SO_RCVTIMEO while idle: keep waiting, unless stopping
                if self._stopping.is_set():
                    raise ConnectionError("worker stopping") from None
        conn.request_since = time.monotonic()
        return P.recv_frame(conn.sock, P.MAX_META if conn.authed else _PREAUTH_META)

    def _cleanup(self, conn: _Conn) -> None:
        """Give back what a departed client held: reservations (never committed) and leases."""
        for offset in conn.reserved:
            self.cache.abort(offset)
        for block in conn.leases.values():
            self.cache.release(block)
        conn.reserved.clear()
        conn.leases.clear()
        _shutdown(conn.sock)
        conn.sock.close()
        with self._conns_lock:
            self._conns.discard(conn)
            t = threading.current_thread()
            if t in self._threads:
                self._threads.remove(t)

    def _dispatch(self, conn: _Conn, frame: P.Frame) -> None:
        handler = self._handlers.get(frame.op)
        if handler is None:
            raise ProtocolError(f"unknown op {frame.op}")
        if not conn.authed and frame.op not in (P.Op.HELLO, P.Op.AUTH):
            P.send_frame(conn.sock, frame.op, P.pack_json({"error": "authenticate first (AUTH with the pool token)"}),
                         status=P.Status.AUTH_REQUIRED, req_id=frame.req_id)
            raise ProtocolError(f"unauthenticated op {frame.op}")
        if frame.data_len and frame.op != P.Op.PUT:
            raise ProtocolError(f"op {frame.op} carries {frame.data_len} data bytes; only PUT carries data")
        if conn.transport == "tcp" and frame.op in _SHM_OPS:
            raise ProtocolError(f"op {frame.op} is for same-node clients over the Unix socket")
        handler(conn, frame)

    def _reply(self, conn: _Conn, frame: P.Frame, meta: bytes = b"", data: list[memoryview] | None = None,
               status: int = P.Status.OK) -> None:
        P.send_frame(conn.sock, frame.op, meta, status=status, req_id=frame.req_id, data=data)

    # ----- handlers ---------------------------------------------------------------------------

    def _hello(self, conn: _Conn, frame: P.Frame) -> None:
        self._reply(conn, frame, P.pack_json(self.info()))

    def _auth(self, conn: _Conn, frame: P.Frame) -> None:
        token = str(P.unpack_json(frame.meta).get("token", ""))
        if self.config.token and not hmac.compare_digest(token.encode(), self.config.token.encode()):
            self._reply(conn, frame, P.pack_json({"error": "bad token"}), status=P.Status.AUTH_FAILED)
            raise ProtocolError("authentication failed")
        conn.authed = True
        conn.sock.settimeout(None)
        self._reply(conn, frame)

    def _put(self, conn: _Conn, frame: P.Frame) -> None:
        keys, (sizes, csums) = P.unpack_batch(frame.meta, "<i8", "<u8")
        total = sum(sizes.tolist())  # Python ints: an int64 sum of huge sizes could wrap to data_len
        if (sizes < 0).any() or total != frame.data_len:
            raise ProtocolError(f"PUT sizes sum to {total}; the frame carries {frame.data_len} bytes")
        status = np.zeros(len(keys), dtype="<i1")
        arena = self.cache.arena
        scratch: bytearray | None = None
        for i, (key, size, csum) in enumerate(zip(keys, sizes.tolist(), csums.tolist())):
            try:
                offset = self.cache.reserve(size)
            except (BlockTooLarge, CapacityError) as e:
                status[i] = P.ITEM_TOO_LARGE if isinstance(e, BlockTooLarge) else P.ITEM_FULL
                scratch = scratch or bytearray(_SCRATCH)
                _drain(conn.sock, size, scratch)
                continue
            try:
                ok = _recv_checked(conn.sock, arena.view(offset, size), csum)
            except BaseException:
                self.cache.abort(offset)
                raise
            if ok:
                self.cache.commit(key, offset, size, csum)  # a pin sent before the block pins it
            else:
                self.cache.abort(offset)
                self.metrics.corrupt_blocks.inc()
                status[i] = P.ITEM_CORRUPT
        self.metrics.bytes.labels("in").inc(frame.data_len)
        self._reply(conn, frame, status.tobytes())

    def _get(self, conn: _Conn, frame: P.Frame) -> None:
        keys, _ = P.unpack_batch(frame.meta)
        blocks = []
        try:
            for k in keys:
                blocks.append(self.cache.acquire(k))
            sizes = np.array([b.size if b else P.ITEM_MISS for b in blocks], dtype="<i8")
            csums = np.array([b.checksum if b else 0 for b in blocks], dtype="<u8")
            arena = self.cache.arena
            data = [arena.view(b.offset, b.size) for b in blocks if b]
            self._reply(conn, frame, sizes.tobytes() + csums.tobytes(), data)
            self.metrics.bytes.labels("out").inc(sum(len(d) for d in data))
            del data
        finally:
            for b in blocks:
                if b:
                    self.cache.release(b)

    def _exists(self, conn: _Conn, frame: P.Frame) -> None:
        keys, _ = P.unpack_batch(frame.meta)
        self._reply(conn, frame, np.array(self.cache.batch_exists(keys), dtype="<u1").tobytes())

    def _prefix(self, conn: _Conn, frame: P.Frame) -> None:
        keys, _ = P.unpack_batch(frame.meta)
        self._reply(conn, frame, P.pack_json({"n": self.cache.prefix_match(keys)}))

    def _remove(self, conn: _Conn, frame: P.Frame) -> None:
        keys, _ = P.unpack_batch(frame.meta)
        self._reply(conn, frame, np.array(self.cache.batch_remove(keys), dtype="<u1").tobytes())

    def _clear(self, conn: _Conn, frame: P.Frame) -> None:
        prefix = P.unpack_batch(frame.meta)[0] if frame.meta else [None]
        if len(prefix) != 1:
            raise ProtocolError(f"CLEAR names {len(prefix)} prefixes; at most one")
        self.cache.clear(prefix[0])
        self._reply(conn, frame)

    def _stats(self, conn: _Conn, frame: P.Frame) -> None:
        self._reply(conn, frame, P.pack_json({**self.info(), "stats": self.cache.stats().as_dict()}))

    def _alloc(self, conn: _Conn, frame: P.Frame) -> None:
        keys, (sizes,) = P.unpack_batch(frame.meta, "<i8")
        offsets = np.full(len(keys), P.ITEM_FULL, dtype="<i8")
        budget = self.max_reserve - sum(conn.reserved.values())
        for i, size in enumerate(sizes.tolist()):
            if size > budget and size <= self.cache.max_block:
                continue  # ITEM_FULL: this connection holds its share of the arena uncommitted
            try:
                offsets[i] = off = self.cache.reserve(size)
                conn.reserved[off] = size
                budget -= size
            except BlockTooLarge:
                offsets[i] = P.ITEM_TOO_LARGE
            except CapacityError:
                pass
        self._reply(conn, frame, offsets.tobytes())

    def _commit(self, conn: _Conn, frame: P.Frame) -> None:
        # A same-node writer copies into the arena itself and sends the checksum of what it wrote
        # (hashed from the arena while hot); every later crossing (TCP, SSD) verifies against it.
        keys, (offsets, sizes, csums) = P.unpack_batch(frame.meta, "<i8", "<i8", "<u8")
        for key, off, size, csum in zip(keys, offsets.tolist(), sizes.tolist(), csums.tolist()):
            if conn.reserved.get(off) != size:
                raise ProtocolError(f"COMMIT of offset {off} ({size} bytes) that this connection did not reserve")
            del conn.reserved[off]
            self.cache.commit(key, off, size, csum)
        self.metrics.bytes.labels("in").inc(int(sizes.sum()))
        self._reply(conn, frame, np.zeros(len(keys), dtype="<i1").tobytes())

    def _abort(self, conn: _Conn, frame: P.Frame) -> None:
        for off in P.unpack_ids(frame.meta).tolist():
            if conn.reserved.pop(off, None) is not None:
                self.cache.abort(off)

    def _lease(self, conn: _Conn, frame: P.Frame) -> None:
        keys, _ = P.unpack_batch(frame.meta)
        n = len(keys)
        ids = np.zeros(n, dtype="<i8")
        offsets = np.full(n, P.ITEM_MISS, dtype="<i8")
        sizes = np.full(n, P.ITEM_MISS, dtype="<i8")
        csums = np.zeros(n, dtype="<u8")
        for i, key in enumerate(keys):
            b = self.cache.acquire(key)
            if b is None:
                continue
            lid = conn.next_lease
            conn.next_lease += 1
            conn.leases[lid] = b
            ids[i], offsets[i], sizes[i], csums[i] = lid, b.offset, b.size, b.checksum
        self.metrics.bytes.labels("out").inc(int(sizes[sizes > 0].sum()))
        self._reply(conn, frame, ids.tobytes() + offsets.tobytes() + sizes.tobytes() + csums.tobytes())

    def _pin(self, conn: _Conn, frame: P.Frame) -> None:
        keys, (seconds,) = P.unpack_batch(frame.meta, "<f8")
        groups: dict[float, list[bytes]] = {}
        for k, s in zip(keys, seconds.tolist()):  # clients send one duration per frame: one call each
            groups.setdefault(s, []).append(k)
        for s, ks in groups.items():
            self.cache.batch_pin(ks, s)

    def _release(self, conn: _Conn, frame: P.Frame) -> None:
        for lid in P.unpack_ids(frame.meta).tolist():
            b = conn.leases.pop(lid, None)
            if b is not None:
                self.cache.release(b)


_RESERVE_SHARE = 8
"""A same-node connection may hold at most 1/8 of the arena reserved and not yet committed."""

_PREAUTH_META = 4096
"""Metadata bytes a frame may carry before its connection authenticates (HELLO and AUTH need little)."""

_SHM_OPS = frozenset({P.Op.ALLOC, P.Op.COMMIT, P.Op.ABORT, P.Op.LEASE, P.Op.RELEASE})


_CHUNK = 64 << 10


def _recv_checked(sock: socket.socket, view: memoryview, csum: int) -> bool:
    """Receive into `view`, hashing each chunk while it is still in cache; True if `csum` matches."""
    h = xxhash.xxh3_64()
    for start in range(0, len(view), _CHUNK):
        chunk = view[start:start + _CHUNK]
        P.recv_exactly(sock, chunk)
        h.update(chunk)
    return h.intdigest() == csum


def _drain(sock: socket.socket, n: int, scratch: bytearray) -> None:
    view = memoryview(scratch)
    while n:
        k = min(n, len(view))
        P.recv_exactly(sock, view[:k])
        n -= k


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
