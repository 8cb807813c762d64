"""The node worker: its lifecycle (bind, start, stop, join the cluster) and what it says of itself.

It serves its TieredCache over TCP (any node) and a Unix socket (same node), one thread per
connection, blocking sockets: block bytes go from the socket straight into arena slots and from arena
slots straight to the socket. Same-node clients map the arena and exchange only small control
messages (alloc/commit, lease/release). How connections are accepted, authenticated and timed is
`kvpool.core.worker_serving`; what each request does is `kvpool.core.worker_ops`; the token and the
challenge-response are `kvpool.core.auth`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .auth import load_or_create_token, private_dir, token_path, write_private
from .cache import TieredCache
from .catch_up import AliveStamp, catch_up
from .config import CacheConfig, WorkerConfig, default_node_id, default_state_dir
from .errors import ConfigError, ListenError, PoolUnavailable, StorageError
from .held_since import HeldSince
from .metrics import WorkerMetrics
from .stall_watch import StallWatch
from .stats import CacheStats
from .tenants import Tenant, TenantUsage, load_tenants
from .worker_ops import RESERVE_SHARE, RequestHandlers

__all__ = ["Worker", "is_local_only", "stored_worker_id"]

log = logging.getLogger("kvpool.worker")

_LOCAL_ONLY = {"127.0.0.1", "::1", "localhost"}


def _unix_listener(path: str) -> socket.socket:
    """A listening Unix socket at `path`, created 0600: only this user's processes connect."""
    parent = Path(path).parent
    private_dir(parent, tighten=parent == default_state_dir())
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


def _holds(stats: CacheStats) -> bool:
    """Whether a cache holds any block, in any tier."""
    return stats.dram_blocks + stats.ssd_blocks + stats.device_blocks > 0


def _id_file(cache: CacheConfig) -> Path | None:
    """Where a worker keeps its id, and its alive and held-since stamps beside it: by its SSD tier (the id
    follows the blocks). None without one: a restart holds no block, so no id needs to outlive the
    worker; it takes a new one each start (unless configured) and leaves no file behind."""
    return Path(cache.ssd_path) / "kvpool-worker-id" if cache.ssd_path else None


def _named_alive_stamp(worker_id: str) -> AliveStamp:
    """The alive stamp of a cluster worker without an SSD tier whose id is configured (`--worker-id`): a
    restart under that id must not vouch for what its last run accepted (`kvpool.core.catch_up`), so it
    is kept in the state dir by id: one small file per name ever configured (a hash for a name unfit
    for a file), where per-port files grew with every start on a new port."""
    fit = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", worker_id)
    name = worker_id if fit else hashlib.sha256(worker_id.encode()).hexdigest()[:32]
    folder = default_state_dir()
    private_dir(folder, tighten=True)
    return AliveStamp(folder / f"worker-id-{name}.alive")


_PORT_FILE = re.compile(r"worker-(\d+)\.(?:sock|id|alive|held)")
"""What a worker without an SSD tier leaves in the state dir by its TCP port: its Unix socket (after a
kill -9), and, from releases that kept them there, its id and alive and held-since stamps."""


def _sweep_dead_workers(folder: Path) -> int:
    """Remove from `folder` (the state dir) the per-port files of workers that no longer run; returns how
    many. A port's files are a live worker's while something listens on the port (in this network
    namespace) or its Unix socket there answers (a worker in another namespace sharing the folder); if
    neither can be told, they are kept. A worker with an SSD tier keeps its files beside it, never here."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    by_port: dict[int, list[str]] = {}
    for name in names:
        m = _PORT_FILE.fullmatch(name)
        if m:
            by_port.setdefault(int(m.group(1)), []).append(name)
    listening = _listening_ports() if by_port else set()
    swept = 0
    for port, files in by_port.items():
        if listening is not None and port in listening:
            continue
        answers = _unix_answers(folder / f"worker-{port}.sock")
        if answers or (answers is None and listening is None):
            continue
        if answers is False:  # it may be one a worker binds right now: that one listens on its TCP port first
            again = _listening_ports()
            if again is None or port in again:
                continue
        for name in files:
            try:
                os.unlink(folder / name)
                swept += 1
            except OSError as e:  # gone already (another start swept it), or not ours to remove
                log.debug("%s not removed: %s", folder / name, e)
    return swept


def _listening_ports() -> set[int] | None:
    """The TCP ports something listens on in this network namespace (the kernel's tables); None where
    they cannot be read (not Linux)."""
    ports: set[int] = set()
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:  # no IPv6, or no /proc
            continue
        read = True
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN; fields[1] is address:port in hex
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports if read else None


def _unix_answers(path: Path) -> bool | None:
    """Whether a process listens on the Unix socket at `path` (a full backlog, or any doubt, counts as
    yes); None if there is nothing at `path`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)  # a live worker's full backlog must not hold up this start
    try:
        sock.connect(str(path))
    except FileNotFoundError:
        return None
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    finally:
        sock.close()
    return True


def stored_worker_id(path: Path) -> str:
    """The id saved at `path`, or a new random one saved there: a restart on the same state keeps its
    id, so placement sends it the keys its SSD tier holds."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        pass
    except OSError as e:  # a file where the folder should be, a link planted as the id file
        raise StorageError(f"cannot read the worker id at {path}: {e.strerror or e}") from e
    else:
        with os.fdopen(fd) as f:
            wid = f.read().strip()
        if wid:
            return wid
    wid = secrets.token_hex(4)
    try:
        private_dir(path.parent, tighten=path.parent == default_state_dir())
        write_private(path, wid + "\n", durable=True)
    except OSError as e:  # a read-only or full disk, a file where the folder should be
        raise StorageError(f"cannot save the worker id at {path}: {e.strerror or e}") from e
    return wid


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
        id_file = _id_file(cache_cfg)
        try:
            swept = _sweep_dead_workers(default_state_dir())
            if swept:
                log.info("removed %d files that workers no longer running left in %s", swept, default_state_dir())
            self.worker_id = cfg.worker_id or (stored_worker_id(id_file) if id_file else secrets.token_hex(4))
            self._alive = (AliveStamp(id_file.with_suffix(".alive")) if id_file else
                           _named_alive_stamp(cfg.worker_id) if cfg.worker_id and cfg.nats_url else None)
            self._catching_up = threading.Lock()
            self._beats = 0  # heartbeats that got through: a catch-up waits for one after the outage
            self.cache = TieredCache(cache_cfg, share_arena=True)
            self._held = HeldSince(id_file.with_suffix(".held") if id_file else None, _holds(self.cache.stats()))
            self._member_since: float | None = None  # since when a member without a break; None: not yet
        except BaseException:
            self._close_listeners()
            raise
        self.max_reserve = max(self.cache.max_block, self.cache.arena.size // RESERVE_SHARE)
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
                self.metrics.serve(self.config.host, self.config.metrics_port)
            if self.config.nats_url:
                from .cluster import Membership

                self.membership = Membership(self.config.nats_url, self.config.member_ttl_s,
                                             replicas=self.config.nats_replicas, role="worker",
                                             creds=self.config.nats_credentials())
                self._catch_up_at_start()
                self.membership.register(self.worker_id, self.info, self.config.heartbeat_s,
                                         on_rejoin=self._left_cluster, on_beat=self._beat)
                self.membership.watch()  # the peers it hears from: whom it asks after an absence
                if self._alive is not None:
                    threading.Thread(target=self._keep_alive_stamp, args=(self._alive,), name="kvpool-alive",
                                     daemon=True).start()
                StallWatch(self.cache.replicas, self._stalled, self._stopping)
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
        self._drain_connections(time.monotonic() + timeout)
        if self.membership is not None and self._alive is not None:
            self._alive.touch()  # its last sign of life: it accepts nothing after the drain
        self.cache.flush()
        self.cache.close()
        if self.events is not None:
            self.events.close()  # after the flush: its last tier moves are published too
        self.metrics.close()
        log.info("worker %s stopped", self.worker_id)

    # ----- catching up after an absence (`kvpool.core.catch_up`) -------------------------------

    def _catch_up_at_start(self) -> None:
        """A start on the state of an earlier run: drop what peers changed since that run's last sign of
        life (everything, if that cannot be told) before serving."""
        cfg = self.config
        last = self._alive.read() if self._alive is not None else None  # None: a new id, or no stamp
        # this run's change log starts now; the last run accepted nothing after its last stamp plus a tick
        self.cache.replicas.covered_since(last + int((2 * cfg.heartbeat_s + 1) * 1000) if last is not None else 0)
        held = self.cache.stats()
        if not _holds(held):
            return
        if last is None:
            log.warning("worker %s: %d blocks from a run that left no alive stamp; dropping them (their age "
                        "cannot be told)", self.worker_id, held.ssd_blocks)
            self.cache.drop_all()
            return
        self._catch_up(last, self.membership.peers())

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
        stamp.touch()
        while not self._stopping.wait(self.config.heartbeat_s):
            stamp.touch()

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
        threading.Thread(target=self._rejoin, args=(since_ms, left, self._beats), name="kvpool-catch-up",
                         daemon=True).start()

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
        with self._catching_up:
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
                    break
                try:
                    self._catch_up(since_ms, members)
                except KVPoolError as e:  # closed under it (stopping)
                    log.debug("catch-up ended: %s", e)
                break
            self.cache.replicas.fence(False)

    def _close_listeners(self, timeout: float = 10.0) -> None:
        self._stop_accepting(timeout)
        try:
            os.unlink(self.unix_path)
        except FileNotFoundError:
            pass

