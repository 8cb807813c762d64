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
An instance whose run ends first keeps what it started (worker, NATS) serving until its peer's run has
ended too (each marks its end in the pool), so the other run never loses half the pool mid-way.
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlparse

from ..client import PoolClient
from ..errors import ConfigError, PoolUnavailable
from ..nats_server import NatsServer
from ..procs import WorkerProcess
from ..records import WorkerInfo

__all__ = ["DEFAULT_NATS", "WAIT_FOR_PEER_S", "Instance", "instance_cluster", "wait_for_peer", "run_started",
    "run_ended"]

log = logging.getLogger("kvpool.bench")

DEFAULT_NATS = "nats://127.0.0.1:4222"
WAIT_FOR_PEER_S = 60.0
"""How long a run waits for `remote_worker` to join, in seconds (the other instance may start later)."""


@dataclasses.dataclass
class Instance:
    instance_id: int
    listen_port: int
    store_dir: str | None = None
    remote_worker: str | None = None
    nats_url: str = DEFAULT_NATS

    def __post_init__(self) -> None:
        if not 0 < self.listen_port < 65536:
            raise ConfigError(f"listen_port {self.listen_port} is not a TCP port (1-65535)")
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


def _nats(inst: Instance, stack: ExitStack, state: Path) -> str:
    """The NATS URL, after starting a server there if none answers and the address is this machine's."""
    u = urlparse(inst.nats_url)
    host, port = u.hostname or "127.0.0.1", u.port or 4222
    if _answers(host, port):
        return inst.nats_url
    if host not in ("127.0.0.1", "localhost"):
        raise PoolUnavailable(f"no NATS server answers at {inst.nats_url} (nats_url of instance {inst.instance_id})")
    # Instances started together must not both start one: the second would see the first's port
    # answer and take that server for its own.
    with open(Path(tempfile.gettempdir()) / f"kvpool-kvtest-nats-{port}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers(host, port):
            return inst.nats_url
        server = NatsServer(state / "nats", port=port, host="127.0.0.1").start()
    stack.callback(server.stop)
    log.info("instance %d started nats-server at %s", inst.instance_id, server.url)
    return server.url


def _worker(inst: Instance, url: str, stack: ExitStack, state: Path, dram_bytes: int) -> bool:
    """Start the instance's worker unless one serves on its port already; True if started."""
    if _answers("127.0.0.1", inst.listen_port):
        log.info("instance %d joins the worker already serving on port %d", inst.instance_id, inst.listen_port)
        return False
    extra = ["--worker-id", inst.worker_id]
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
        url = _nats(inst, stack, state)
        _worker(inst, url, stack, state, dram_bytes)
        yield url


def wait_for_peer(client: PoolClient, inst: Instance, timeout: float = WAIT_FOR_PEER_S) -> None:
    """Block until the client sees this instance's worker and the one at `remote_worker`."""
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


def _end_mark(worker_id: str) -> str:
    return f"kvtest/{worker_id}/run-ended"


def _peer_id(client: PoolClient, inst: Instance) -> str | None:
    if not inst.remote_worker:
        return None
    port = inst.remote_worker.rpartition(":")[2]
    return next((w for w, i in client.members().items() if i.tcp.rpartition(":")[2] == port), None)


def run_started(client: PoolClient, inst: Instance) -> None:
    """Clear this instance's end mark of an earlier run (before the peer can look for it)."""
    client.remove(_end_mark(inst.worker_id))


def run_ended(client: PoolClient, inst: Instance, timeout: float = WAIT_FOR_PEER_S) -> None:
    """Mark this instance's run as ended, then wait (up to `timeout` s) for the peer's mark: until then
    the peer still reads and writes blocks on this instance's worker."""
    client.put(_end_mark(inst.worker_id), b"1")
    peer = _peer_id(client, inst)
    if peer is None:
        return
    deadline = time.monotonic() + timeout
    logged = False
    while client.get(_end_mark(peer)) is None:
        if _peer_id(client, inst) is None:
            log.info("instance %d: peer %s has left the cluster", inst.instance_id, peer)
            return
        if time.monotonic() > deadline:
            log.warning("instance %d: peer %s still running after %.0f s; stopping anyway",
                        inst.instance_id, peer, timeout)
            return
        if not logged:
            log.info("instance %d: run ended; serving until peer %s ends its run", inst.instance_id, peer)
            logged = True
        time.sleep(0.2)
