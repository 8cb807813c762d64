"""The node worker: its lifecycle (bind, start, stop, join the cluster) and what it says of itself.

It serves its TieredCache over TCP (any node) and a Unix socket (same node), one thread per
connection, blocking sockets: block bytes go from the socket straight into arena slots and from arena
slots straight to the socket. Same-node clients map the arena and exchange only small control
messages (alloc/commit, lease/release). How connections are accepted, authenticated and timed is
`kvpool.core.worker_serving`; what each request does is `kvpool.core.worker_ops`; the token and the
challenge-response are `kvpool.core.auth`; what it keeps on disk about itself (its id, its alive stamp)
and the sweep of dead workers' files is `kvpool.core.state_files`.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from . import protocol as P
from .auth import load_or_create_token, private_dir, token_path
from .cache import TieredCache
from .catch_up import AliveStamp, catch_up
from .config import CacheConfig, WorkerConfig, default_node_id, default_state_dir
from .errors import ConfigError, ListenError, PoolUnavailable
from .held_since import HeldSince
from .metrics import WorkerMetrics
from .stall_watch import StallWatch
from .state_files import binding, id_file, named_alive_stamp, stored_worker_id, sweep_dead_workers
from .stats import CacheStats
from .tenants import Tenant, TenantUsage, load_tenants
from .versions import CLOCK_SKEW_MS
from .worker_ops import RESERVE_SHARE, RequestHandlers

__all__ = ["Worker", "is_local_only"]

log = logging.getLogger("kvpool.worker")

_LOCAL_ONLY = {"127.0.0.1", "::1", "localhost"}


def _unix_listener(path: str) -> socket.socket:
    """A listening Unix socket at `path`, created 0600: only this user's processes connect."""
    parent = Path(path).parent
    private_dir(parent, tighten=parent == default_state_dir())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        # (in the state dir, which each worker start sweeps: a sweep does not remove it meanwhile)
        with binding(parent) if parent == default_state_dir() else nullcontext():
            if os.path.exists(path):
                os.unlink(path)
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


def _holds(stats: CacheStats) -> bool:
    """Whether a cache holds any block, in any tier."""
    return stats.dram_blocks + stats.ssd_blocks + stats.device_blocks > 0


def is_local_only(host: str) -> bool:
    """Binds that no other machine (or other loopback address) can reach without a token."""
    return host in _LOCAL_ONLY


def _worker_token(cfg: WorkerConfig) -> str | None:
    """The token TCP clients must prove they hold: the configured one; none with `no_auth` (loopback
    only); else, on loopback, the token file's (made at first start)."""
    if cfg.no_auth:
        if not is_local_only(cfg.host):
            raise ConfigError(f"--no-auth is for loopback binds only; {cfg.host} needs a token")
        if cfg.token:
            raise ConfigError("both a token and --no-auth (KVPOOL_NO_AUTH) are set: choose one")
        log.warning("authentication is off (--no-auth): every local user can read, write and clear this pool")
        return None
    if cfg.token:
        return cfg.token
    if not is_local_only(cfg.host):
        raise ConfigError(f"binding {cfg.host} (not 127.0.0.1) needs a token: set KVPOOL_TOKEN or --token")
    return load_or_create_token(token_path())


def _worker_tenants(cfg: WorkerConfig, token: str | None) -> dict[str, Tenant]:
    """The tenant tokens of `cfg.tenants_file` (none without one); they need authentication on."""
    if not cfg.tenants_file:
        return {}
    if token is None:
        raise ConfigError("tenants (--tenants, KVPOOL_TENANTS_FILE) need authentication: drop --no-auth")
    tenants = load_tenants(cfg.tenants_file, token)
    log.info("%d tenant token(s) from %s, each bound to its namespace '<tenant>/'", len(tenants), cfg.tenants_file)
    return tenants


class Worker(RequestHandlers):
    """A kvpool worker. `start()` binds and serves in background threads; `stop()` drains and flushes."""

    def __init__(self, config: WorkerConfig | None = None, cache: CacheConfig | None = None) -> None:
        from .config import load

        self.config = cfg = config if config is not None else load(WorkerConfig)
        self.token = _worker_token(cfg)
        self.tenants = _worker_tenants(cfg, self.token)
        if cfg.host in ("0.0.0.0", "::", "") and not cfg.advertise_host and cfg.nats_url:
            raise ConfigError(f"binding the wildcard {cfg.host!r} in a cluster needs --advertise-host (the address "
                              "other machines reach this worker at); a wildcard is no address to advertise")
        cache_cfg = cache if cache is not None else load(CacheConfig)
        self.node_id = cfg.node_id or default_node_id()
        self._init_serving()
        self.membership: Any = None
        self.metrics_port: int | None = None
        """The port its Prometheus metrics are served on, from `start` (None: not served)."""
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
        id_path = id_file(cache_cfg)
        try:
            swept = sweep_dead_workers(default_state_dir())
            if swept:
                log.info("removed %d files that workers no longer running left in %s", swept, default_state_dir())
            self.worker_id = cfg.worker_id or (stored_worker_id(id_path) if id_path else secrets.token_hex(4))
            self._alive = (AliveStamp(id_path.with_suffix(".alive")) if id_path else
                           named_alive_stamp(cfg.worker_id) if cfg.worker_id and cfg.nats_url else None)
            self._stamped = self._alive.read() if self._alive is not None else None  # None: a new id, or no stamp
            self._current_ms = self._stamped[1] if self._stamped is not None else None
            """The last time this worker could vouch for every block it holds (`AliveStamp`); None: never."""
            self._catching_up = threading.Lock()
            self._beats = 0  # heartbeats that got through: a catch-up waits for one after the outage
            self.cache = TieredCache(cache_cfg, share_arena=True)
            self._held = HeldSince(id_path.with_suffix(".held") if id_path else None, _holds(self.cache.stats()))
            self._member_since: float | None = None  # since when a member without a break; None: not yet
        except BaseException:
            self._close_listeners()
            raise
        self.max_reserve = max(self.cache.max_block + P.RESERVE_FLOOR, self.cache.arena.size // RESERVE_SHARE)
        """Bytes one same-node connection may hold allocated but not committed: a client that stalls
        between ALLOC and COMMIT (it writes the arena itself, so its slots cannot be taken back while
        it lives) blocks at most this much of the arena."""
        ssd = self.cache.ssd
        self.tenant_usage = TenantUsage(self.tenants, ssd.size_of if ssd is not None else None)
        if self.tenants:  # replay: blocks found on SSD at start count toward their tenants' quotas
            self.cache.add_listener(self.tenant_usage, replay=True)
        self.metrics = WorkerMetrics(lambda: self.cache.stats().as_dict())
        self._init_handlers()

    # ----- lifecycle --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.config.advertise_host or self.config.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        """What the worker registers in the cluster and answers to HELLO. `member_since` and `held_since`
        say whom a put tells to drop older copies (`kvpool.core.succession`)."""
        s = self.cache.stats()
        return {"worker_id": self.worker_id, "node_id": self.node_id, "tcp": self.address,
                "unix": self.unix_path, "arena": self.cache.arena.name, "arena_size": self.cache.arena.length,
                "dram_capacity": s.dram_capacity, "dram_bytes": s.dram_bytes,
                "ssd_bytes": s.ssd_bytes, "hits": s.hits_dram + s.hits_ssd + s.hits_device,
                "misses": s.misses, "max_block": self.cache.max_block, "max_reserve": self.max_reserve,
                "transports": ["tcp", "shm"],
                "auth": bool(self.token), "pid": os.getpid(),
                "member_since": time.time() if self._member_since is None else self._member_since,
                "member_ttl_s": self.config.member_ttl_s,
                "held_since": self._held.now(_holds(s))}

    def start(self) -> Worker:
        """Serve in background threads and join the cluster. If any of it fails (metrics port in use,
        NATS unreachable), everything the worker holds is released, its arena first, and the error raised."""
        try:
            if self.config.metrics_port is not None:
                self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
            if self.config.nats_url:
                from .cluster import Membership

                self.membership = Membership(self.config.nats_url, self.config.member_ttl_s,
                                             replicas=self.config.nats_replicas, role="worker",
                                             creds=self.config.nats_credentials())
                caught_up = self._catch_up_at_start()
                if caught_up is not None:  # blocks kept, peers around: see `_settle`
                    self.cache.replicas.fence(True)
                self.membership.register(self.worker_id, self.info, self.config.heartbeat_s,
                                         on_rejoin=self._left_cluster, on_beat=self._beat)
                self.membership.watch()  # the peers it hears from: whom it asks after an absence
                if caught_up is not None:
                    self._in_background(self._settle, *caught_up, name="kvpool-settle")
                if self._alive is not None:
                    self._in_background(self._keep_alive_stamp, self._alive, name="kvpool-alive")
                self._helpers.append(StallWatch(self.cache.replicas, self._stalled, self._stopping).thread)
            if self.config.events or self.config.events_zmq:
                from .worker_events import WorkerEvents

                self.events = WorkerEvents(self)
        except BaseException:
            self._stopping.set()
            self.metrics.close()
            if self.membership is not None:
                self.membership.close()
            self._close_listeners()
            self.cache.close()
            raise
        self._serve_in_background()
        log.info("worker %s serving tcp %s and %s (arena %s, %d bytes)%s", self.worker_id, self.address,
                 self.unix_path, self.cache.arena.name, self.cache.arena.size,
                 "" if self.metrics_port is None else f", metrics on port {self.metrics_port}")
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
        self._drain_connections(deadline)
        # its own threads end before the cache closes and the process exits: a log line written as the
        # interpreter exits aborts it (iterated, not copied: one appended meanwhile is joined too)
        for t in self._helpers:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.membership is not None and self._alive is not None:
            self._touch_alive(self._alive)  # its last sign of life: it accepts nothing after the drain
        self.cache.flush()
        if self.events is not None:  # after the flush (its last tier moves are published too), before the
            self.events.close()  # cache closes: it takes back the DRAM copies, reading what SSD keeps
        self.cache.close()
        self.metrics.close()
        log.info("worker %s stopped", self.worker_id)

    # ----- catching up after an absence (`kvpool.core.catch_up`) -------------------------------

    def _in_background(self, target: Callable[..., None], *args: Any, name: str) -> None:
        """Run `target(*args)` in a thread that `stop` joins (it returns once `_stopping` is set). Kept
        after it ends (one per stall or lapse): an append is safe from any thread, a pruning copy is not."""
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._helpers.append(t)
        t.start()

    def _catch_up_at_start(self) -> tuple[int, float] | None:
        """A start on the state of an earlier run: drop what peers changed since that run was last current
        (its last sign of life but after an absence it had not caught up on; everything, if that cannot be
        told) before serving. Where it keeps blocks and has peers:
        when this catch-up began (unix ms, less the clock-skew bound) and time.monotonic(), for `_settle`."""
        cfg = self.config
        stamped = self._stamped
        # this run's change log starts now; the last run accepted nothing after its last stamp plus a tick
        self.cache.replicas.covered_since(stamped[0] + int((2 * cfg.heartbeat_s + 1) * 1000) if stamped else 0)
        last = self._current_ms  # it may have missed what peers accepted since then
        held = self.cache.stats()
        if not _holds(held):
            return None
        if last is None:
            log.warning("worker %s: %d blocks from a run that left no alive stamp; dropping them (their age "
                        "cannot be told)", self.worker_id, held.ssd_blocks)
            self.cache.drop_all()
            return None
        began = (int(time.time() * 1000) - CLOCK_SKEW_MS, time.monotonic())
        peers = self.membership.peers()
        self._catch_up(last, peers)
        return began if {w for w in peers if w != self.worker_id} and _holds(self.cache.stats()) else None

    def _settle(self, since_ms: int, began: float) -> None:
        """After a start on kept blocks: reads of them are misses for a member TTL, then a second catch-up
        learns what peers accepted since the first began (`since_ms`). A client that had not seen this
        worker register yet (its member view a moment behind; its NATS link held up, within the TTL)
        wrote this worker's keys to the worker standing in for it, after the first catch-up asked that
        one (an adversarial check: 96 of 96 such keys served old)."""
        from .errors import KVPoolError

        log.info("worker %s: blocks kept from its last run are misses for %.0f s (member TTL), until it has "
                 "learnt what clients that had not seen it back wrote elsewhere", self.worker_id,
                 self.config.member_ttl_s)
        done = False  # a stop cuts it short: reads stay fenced, and so the alive stamp (`_touch_alive`)
        try:
            if self._stopping.wait(self.config.member_ttl_s):
                return
            self.metrics.catch_ups.labels("start").inc()
            peers = {w: info for w, info in {**self.membership.heard_since(began), **self.membership.peers()}.items()
                     if w != self.worker_id}
            with self._catching_up:
                # A peer gone or restarted meanwhile (a rolling restart) is passed over, not taken as a reason
                # to drop every block: the first catch-up covered the time this worker was away, this one only
                # its first member TTL back. One serving all along whose log no longer reaches back is.
                if not catch_up(self.cache, peers, since_ms, token=self.token, node_id=self.node_id, partial=True):
                    log.warning("worker %s: a peer could not tell what it accepted since this worker came back; "
                                "dropping its blocks (misses, never outdated bytes)", self.worker_id)
                    self.cache.drop_all()
            done = True
        except KVPoolError as e:  # closed under it (stopping)
            log.debug("second catch-up ended: %s", e)
        finally:
            if done or not self._stopping.is_set():
                self.cache.replicas.fence(False)

    def _catch_up(self, since_ms: int, members: dict[str, Any]) -> None:
        peers = {w: info for w, info in members.items() if w != self.worker_id}
        if not peers:
            log.info("worker %s: no live peer to catch up from; keeping its blocks", self.worker_id)
            return
        if not catch_up(self.cache, peers, since_ms, token=self.token, node_id=self.node_id):
            log.warning("worker %s: could not learn every change made while it was away; dropping its blocks "
                        "(misses, never outdated bytes)", self.worker_id)
            self.cache.drop_all()

    def _beat(self) -> None:
        """A heartbeat got through: reads stay open for one member TTL (less a beat) from now. The first
        after the start or an outage makes it a member again from now (`member_since`: clients hear of
        it from then; a registration or heartbeat may be retried for many seconds before that)."""
        self._beats += 1  # only the NATS thread writes it
        if self._member_since is None:
            self._member_since = time.time()
        self.cache.replicas.fence_after(self.config.member_ttl_s - self.config.heartbeat_s)

    def _keep_alive_stamp(self, stamp: AliveStamp) -> None:
        """The alive stamp, every heartbeat (and at stop): not NATS's, so a worker cut off from NATS that
        still accepts writes keeps stamping."""
        self._touch_alive(stamp)
        while not self._stopping.wait(self.config.heartbeat_s):
            self._touch_alive(stamp)

    def _touch_alive(self, stamp: AliveStamp) -> None:
        """Stamp now, and the last time it was current: a stall or lapse not caught up yet (one a stop
        cuts short included: it stopped as it woke) leaves that at its last stamp before the absence, so
        a restart catches up on what it missed (an adversarial check: a replica stopped as it woke from a
        pause later served a block overwritten meanwhile)."""
        if self.cache.replicas.current():
            self._current_ms = int(time.time() * 1000)
        stamp.touch(self._current_ms)

    def _left_cluster(self, gap_s: float) -> None:
        """Heartbeats lapsed past the member TTL (NATS out of reach, or this process paused): clients may
        have dropped this worker and written its keys to others, so its blocks may be outdated. Its
        reads are misses until it has caught up from its peers (in a thread: this is the NATS one)."""
        log.warning("worker %s: no heartbeat got through for %.1f s (member TTL %.1f s): reads are misses until "
                    "it has caught up from its peers", self.worker_id, gap_s, self.config.member_ttl_s)
        self.metrics.catch_ups.labels("lapse").inc()
        self._fence_and_rejoin(gap_s)

    def _stalled(self, gap_s: float) -> None:
        """The process did not run for `gap_s` seconds (`kvpool.core.stall_watch`): clients may have taken
        it as down and written its keys' other replicas alone. As after lapsed heartbeats."""
        log.warning("worker %s: stalled for %.1f s (paused?): reads are misses until it has caught up from its "
                    "peers", self.worker_id, gap_s)
        self.metrics.catch_ups.labels("stall").inc()
        self._fence_and_rejoin(gap_s)

    def _fence_and_rejoin(self, gap_s: float) -> None:
        """Reads are misses (but for what it accepts from now on) until a catch-up from its peers of what
        they accepted in the last `gap_s` seconds has ended (`_rejoin`, in a thread of its own)."""
        self.cache.replicas.fence(True)
        self._member_since = None  # clients took it as gone: a member again from its next heartbeat (`_beat`)
        since_ms = int((time.time() - gap_s) * 1000)
        left = time.monotonic() - gap_s
        self._in_background(self._rejoin, since_ms, left, self._beats, name="kvpool-catch-up")

    def _rejoin(self, since_ms: int, left: float, beats: int) -> None:
        """Catch up once a heartbeat has got through again (`beats` counted before the outage) and the
        member list can be read; after a minute (or three TTLs) without both, drop every block instead.
        Not before that heartbeat: until then what this worker can read of NATS may be a partition's
        view (a NATS node cut off with it lists no live peer), and clients may still be writing its
        keys elsewhere. It asks the members live now and every peer it heard from since a member TTL
        before it left (`left`, time.monotonic()): a client may have written to any of them meanwhile,
        and one whose heartbeats lapse just now (a JetStream leader election stalls them all) is not
        listed live, yet holds what changed; one that cannot answer makes it drop every block."""
        from .errors import KVPoolError

        horizon = left - self.config.member_ttl_s - self.config.heartbeat_s
        done = False  # a stop cuts it short: reads stay fenced, and so the alive stamp (`_touch_alive`)
        with self._catching_up:
            try:
                give_up = time.monotonic() + max(60.0, 3 * self.config.member_ttl_s)
                while not self._stopping.is_set():
                    try:
                        if self._beats == beats:
                            raise PoolUnavailable("no heartbeat has got through since the outage")
                        members = {**self.membership.heard_since(horizon), **self.membership.peers()}
                    except KVPoolError as e:
                        if time.monotonic() < give_up:
                            self._stopping.wait(0.2)
                            continue
                        log.warning("worker %s: not back in the cluster (%s); dropping its blocks", self.worker_id, e)
                        self.cache.drop_all()
                        done = True
                        break
                    try:
                        self._catch_up(since_ms, members)
                        done = True
                    except KVPoolError as e:  # closed under it (stopping)
                        log.debug("catch-up ended: %s", e)
                    break
            finally:
                if done or not self._stopping.is_set():
                    self.cache.replicas.fence(False)

    def _close_listeners(self, timeout: float = 10.0) -> None:
        self._stop_accepting(timeout)
        try:
            os.unlink(self.unix_path)
        except FileNotFoundError:
            pass

