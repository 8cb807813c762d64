"""kvtest's multi-node mode on kvpool: an instance config names a worker, and the peer it must reach.

openYuanrong kvtest users run two instances on one machine, each with its own worker and store folder
(`{"instance_id": 0, "listen_port": 8080, "rocksdb_store_dir": "./rocksdb0", "remote_worker":
"127.0.0.1:8081"}`), a writer on one and a reader on the other. Here instance N is the kvpool worker
`kvtest-N` on node `kvtest-N` listening on `listen_port`, its SSD tier (LMDB) in `rocksdb_store_dir`:
joined if one already serves on that port, else started for the run (and stopped after it). Both
register at the NATS server `nats_url` (default `nats://127.0.0.1:4222`, started by the first instance
if none answers there), and a run waits until `remote_worker` has joined too, so both instances place
keys over the same two workers. Distinct node ids make the other instance's worker a remote one: this
instance reaches its own worker through shared memory and the other through TCP, as across machines.
A NATS server that asks for credentials (`kvpool up`'s) is joined with the user's own: the worker
registers with the worker role's, the bench client uses the client and admin roles' (`find_creds`:
KVPOOL_NATS_CREDS, else `<state dir>/nats/<role>.json`); without them the run stops before it starts.
An instance whose run ends first keeps what it started (worker, NATS) serving until its peer's run has
ended too (each marks in the pool how its run ended), so the other run never loses half the pool
mid-way; a peer whose run failed, or that left without ending its run, fails the pairing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlparse

from ..auth import private_dir
from ..client import PoolClient
from ..config import default_state_dir
from ..errors import ConfigError, KVPoolError, PoolUnavailable
from ..nats_creds import Role, creds_path, find_creds
from ..nats_server import NatsServer
from ..procs import WorkerProcess
from ..records import WorkerInfo

__all__ = ["DEFAULT_NATS", "WAIT_FOR_PEER_S", "Instance", "check_listen_port", "instance_cluster", "wait_for_peer",
    "run_started", "run_ended", "run_failed", "peer_failure"]

log = logging.getLogger("kvpool.bench")

DEFAULT_NATS = "nats://127.0.0.1:4222"
WAIT_FOR_PEER_S = 60.0
"""How long a run waits for `remote_worker` to join, in seconds (the other instance may start later)."""



def check_listen_port(port: int) -> None:
    """ConfigError unless `port` (a kvtest config's `listen_port`) is a TCP port a worker can listen on."""
    if not 0 < port < 65536:
        raise ConfigError(f"listen_port {port} is not a TCP port (1-65535)")

@dataclasses.dataclass
class Instance:
    instance_id: int
    listen_port: int
    store_dir: str | None = None
    remote_worker: str | None = None
    nats_url: str = DEFAULT_NATS

    def __post_init__(self) -> None:
        check_listen_port(self.listen_port)
        if self.remote_worker is not None:
            _host_port(self.remote_worker, "remote_worker")

    @property
    def worker_id(self) -> str:
        """The worker's id and node id: `kvtest-<instance_id>`."""
        return f"kvtest-{self.instance_id}"


def _host_port(address: str, what: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {address!r} is not host:port")
    return host, int(port)


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _nats_info(host: str, port: int) -> dict[str, object]:
    """The INFO a NATS server greets a client with ({} if what answers there says nothing like it)."""
    buf = b""
    try:
        with socket.create_connection((host, port), timeout=2.0) as sock:
            while b"\r\n" not in buf and len(buf) < 1 << 16:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                buf += chunk
    except OSError:
        return {}
    line = buf.partition(b"\r\n")[0]
    if not line.startswith(b"INFO "):
        return {}
    try:
        info = json.loads(line[5:])
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


_LOCK_NAME = "kvpool-kvtest-nats-{port}.lock"


@contextmanager
def _port_lock(port: int) -> Iterator[None]:
    """Held by one process at a time (of this user's that start a kvtest instance's NATS on `port`): an
    flock on a file in the state folder (private: in a shared temp folder another user could hold it for
    ever), which the holder removes before it lets go, so none is left behind. A waiter that then gets
    the lock of the removed file finds the name gone (or naming a newer file) and takes the lock again
    on what the name now names."""
    path = private_dir(default_state_dir(), tighten=True) / _LOCK_NAME.format(port=port)
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                named = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino):
                continue
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return
        finally:
            os.close(fd)


def _nats(inst: Instance, stack: ExitStack, state: Path) -> tuple[str, bool]:
    """The NATS URL, after starting a server there if none answers and the address is this machine's;
    and whether this instance started it."""
    u = urlparse(inst.nats_url)
    host, port = u.hostname or "127.0.0.1", u.port or 4222
    if _answers(host, port):
        return inst.nats_url, False
    if host not in ("127.0.0.1", "localhost"):
        raise PoolUnavailable(f"no NATS server answers at {inst.nats_url} (nats_url of instance {inst.instance_id})")
    # Instances started together must not both start one: the second would see the first's port
    # answer and take that server for its own.
    with _port_lock(port):
        if _answers(host, port):
            return inst.nats_url, False
        server = NatsServer(state / "nats", port=port, host="127.0.0.1").start()
    stack.callback(server.stop)
    log.info("instance %d started nats-server at %s", inst.instance_id, server.url)
    return server.url, True


def _joined_creds(inst: Instance, url: str, roles: tuple[Role, ...]) -> str | None:
    """The credentials file the instance's worker registers with at the NATS server it joins (None: it
    asks for none, or the URL carries them). A server that asks for credentials gets the user's own,
    as every kvpool process finds them (`find_creds`): those of the `kvpool up` that runs it. Where a
    role of `roles` has none, ConfigError now, rather than an AuthError from inside the worker later."""
    u = urlparse(url)
    if u.username or not _nats_info(u.hostname or "127.0.0.1", u.port or 4222).get("auth_required"):
        return None
    missing = [r for r in roles if find_creds(r) is None]
    if missing:
        raise ConfigError(
            f"the NATS server at {url} (nats_url of instance {inst.instance_id}) requires credentials, and this user "
            f"has none for the {', '.join(missing)} role{'s' if len(missing) > 1 else ''} (not in "
            f"{creds_path(missing[0]).parent}/, KVPOOL_NATS_CREDS unset): run the instances with the KVPOOL_STATE_DIR "
            f"of the `kvpool up` that serves it (now {default_state_dir()}), stop that `kvpool up`, or give them "
            "another NATS port (\"nats_url\" in the instance config, or --cluster nats://127.0.0.1:PORT), which the "
            "first instance then starts")
    worker = find_creds("worker")
    log.info("instance %d joins the NATS server at %s as the users of %s", inst.instance_id, url,
             os.environ.get("KVPOOL_NATS_CREDS") or creds_path("worker").parent)
    return worker.path if worker is not None else None


def _worker(inst: Instance, url: str, stack: ExitStack, state: Path, dram_bytes: int, creds: str | None) -> bool:
    """Start the instance's worker unless one serves on its port already (registering with the NATS
    credentials in the file `creds`, if any); True if started."""
    if _answers("127.0.0.1", inst.listen_port):
        log.info("instance %d joins the worker already serving on port %d", inst.instance_id, inst.listen_port)
        return False
    extra = ["--worker-id", inst.worker_id] + (["--nats-creds", creds] if creds else [])
    if inst.store_dir:
        Path(inst.store_dir).mkdir(parents=True, exist_ok=True)
        extra += ["--ssd-path", str(Path(inst.store_dir).resolve()),
                  "--ssd-map-size", str(max(4 << 30, 4 * dram_bytes))]
    proc = WorkerProcess(state / "worker", nats_url=url, dram_bytes=str(dram_bytes), node_id=inst.worker_id,
                         extra=extra, port=inst.listen_port)
    stack.callback(proc.stop)
    proc.wait_ready()
    log.info("instance %d started worker %s on port %d (store %s)", inst.instance_id, inst.worker_id,
             inst.listen_port, inst.store_dir or "none")
    return True


@contextmanager
def instance_cluster(inst: Instance, dram_bytes: int) -> Iterator[str]:
    """NATS and the instance's worker, started or joined; yields the NATS URL; stops what it started."""
    with ExitStack() as stack:
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvtest-{inst.instance_id}-")))
        url, started = _nats(inst, stack, state)
        serving = _answers("127.0.0.1", inst.listen_port)
        # its worker registers as the worker role; the bench client reads membership (client) and creates
        # and uses the notification stream (admin, client)
        roles: tuple[Role, ...] = ("client", "admin") if serving else ("worker", "client", "admin")
        creds = None if started else _joined_creds(inst, url, roles)
        _worker(inst, url, stack, state, dram_bytes, creds)
        yield url


def wait_for_peer(client: PoolClient, inst: Instance, timeout: float = WAIT_FOR_PEER_S) -> str | None:
    """Block until the client sees this instance's worker and the one at `remote_worker`; the peer's
    worker id (None without `remote_worker`)."""
    want_port = _host_port(inst.remote_worker, "remote_worker")[1] if inst.remote_worker else None

    def ready(members: dict[str, WorkerInfo]) -> bool:
        ports = {i.tcp.rpartition(":")[2] for i in members.values()}
        mine = str(inst.listen_port) in ports
        return mine and (want_port is None or str(want_port) in ports)

    t0 = time.monotonic()
    if not client.wait_for_members(ready, timeout):
        raise PoolUnavailable(f"remote_worker {inst.remote_worker} did not join the cluster at {inst.nats_url} "
                              f"within {timeout:.0f} s: start the other instance (kvpool bench cache --config ...)")
    log.info("instance %d sees its peer %s after %.1f s", inst.instance_id, inst.remote_worker, time.monotonic() - t0)
    return _peer_id(client, inst)


def _end_mark(worker_id: str) -> str:
    return f"kvtest/{worker_id}/run-ended"


def _seen_mark(worker_id: str) -> str:
    """Put by an instance once it has seen its peer's end mark: the peer may go (and take its worker,
    which may hold the mark, with it) without leaving the instance unsure how its run ended."""
    return f"kvtest/{worker_id}/saw-peer-end"


def _mark(failure: str | None, waits: bool) -> bytes:
    """An end mark: how the run ended (`failure`: why it failed; None: well), and whether its instance
    waits for the peer's mark before it goes (a run that raised does not)."""
    return json.dumps({"failure": failure, "waits": waits}).encode()


def _read_mark(mark: bytes) -> tuple[str | None, bool]:
    if bytes(mark) == b"1":  # an earlier version's: it ended well, and waited
        return None, True
    try:
        got = json.loads(mark)
        return (None if got["failure"] is None else str(got["failure"])), bool(got["waits"])
    except (ValueError, TypeError, KeyError):
        return f"unreadable end mark {bytes(mark)[:80]!r}", False


def _peer_id(client: PoolClient, inst: Instance) -> str | None:
    if not inst.remote_worker:
        return None
    port = inst.remote_worker.rpartition(":")[2]
    return next((w for w, i in client.members().items() if i.tcp.rpartition(":")[2] == port), None)


def _get(client: PoolClient, key: str) -> bytes | None:
    """A mark, or None while it cannot be read (the worker that holds it may be leaving)."""
    try:
        return client.get(key)
    except PoolUnavailable:
        return None


def run_started(client: PoolClient, inst: Instance) -> None:
    """Clear this instance's marks of an earlier run (before the peer can look for them)."""
    client.remove(_end_mark(inst.worker_id))
    client.remove(_seen_mark(inst.worker_id))


def run_failed(client: PoolClient, inst: Instance, why: str) -> None:
    """Mark this instance's run as failed, if the pool still takes it, and do not wait: the peer then
    reports a failed pairing (it would too, less precisely, once this instance's worker left)."""
    try:
        client.put(_end_mark(inst.worker_id), _mark(why, waits=False))
    except KVPoolError as e:  # the pool may be what failed
        log.info("instance %d: could not mark its run as failed: %s", inst.instance_id, e)


def _failure(inst: Instance, peer: str, mark: bytes) -> str | None:
    failure = _read_mark(mark)[0]
    return None if failure is None else f"peer {peer} ({inst.remote_worker}): its run failed: {failure}"


def _left(inst: Instance, peer: str) -> str:
    return (f"peer {peer} ({inst.remote_worker}) left the cluster without ending its run: it failed or was stopped "
            "(see its output)")


def peer_failure(client: PoolClient, inst: Instance, peer: str | None) -> str | None:
    """Why the peer's run failed, as far as can be told now (its end mark says so, or it left the
    cluster without one); None while it runs, once it ended well, and without a peer."""
    if peer is None:
        return None
    mark = _get(client, _end_mark(peer))
    if mark is not None:
        return _failure(inst, peer, mark)
    return _left(inst, peer) if peer not in client.members() else None


def run_ended(client: PoolClient, inst: Instance, peer: str | None, failure: str | None = None,
              timeout: float = WAIT_FOR_PEER_S) -> str | None:
    """Mark this instance's run as ended (`failure`: why it failed, None if it did not), then wait (up
    to `timeout` s) for the peer's mark: until then the peer still reads and writes blocks on this
    instance's worker. Returns why the pairing failed, as the peer's side shows it: its run failed, or
    it left the cluster without ending its run; None when it ended well (or still runs after
    `timeout`: logged)."""
    client.put(_end_mark(inst.worker_id), _mark(failure, waits=True))
    if peer is None:
        return None
    deadline = time.monotonic() + timeout
    logged = False
    while (mark := _get(client, _end_mark(peer))) is None:
        if peer not in client.members():
            return _left(inst, peer)
        if time.monotonic() > deadline:
            log.warning("instance %d: peer %s still running after %.0f s; stopping anyway",
                        inst.instance_id, peer, timeout)
            return None
        if not logged:
            log.info("instance %d: run ended; serving until peer %s ends its run", inst.instance_id, peer)
            logged = True
        time.sleep(0.2)
    client.put(_seen_mark(inst.worker_id), b"1")
    # Stay until a waiting peer has seen this mark too, or has gone: leaving earlier could take the
    # worker that holds this mark with it, and the peer would take this run for one that failed.
    while (_read_mark(mark)[1] and _get(client, _seen_mark(peer)) is None and peer in client.members()
           and time.monotonic() < deadline):
        time.sleep(0.2)
    return _failure(inst, peer, mark)
