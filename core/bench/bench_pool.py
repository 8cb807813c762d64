"""The pool a bench runs against: the embedded default, local workers it starts, or an existing cluster.

Local workers are real `kvpool worker` processes registered at a nats-server of their own, so a
`--workers N` run goes through the same placement, transports and membership as a deployment.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from ..client import PoolClient
from ..errors import PoolUnavailable
from ..nats_server import NatsServer
from ..procs import WorkerProcess
from ..records import PoolStats
from .kvtest_instance import Instance, instance_cluster, peer_failure, run_ended, run_failed, run_started, wait_for_peer

__all__ = ["local_cluster", "wait_members", "totals", "BenchPool"]

_SLAB = 16 << 20
_TOTALS = ("hits_device", "hits_dram", "hits_ssd", "misses", "evictions", "demotions", "promotions",
           "dram_bytes", "dram_capacity", "ssd_bytes", "device_bytes")


@contextmanager
def local_cluster(state_dir: str | Path, workers: int, *, dram_bytes: int, ssd: bool = False) -> Iterator[str]:
    """A nats-server and `workers` worker processes under `state_dir`; yields the NATS URL; stops all."""
    state = Path(state_dir)
    nats = NatsServer(state / "nats", port=0).start()
    procs: list[WorkerProcess] = []
    try:
        procs += [WorkerProcess(state / f"w{i}", nats_url=nats.url, dram_bytes=str(dram_bytes), ssd=ssd)
                  for i in range(workers)]
        for w in procs:
            w.wait_ready()
        yield nats.url
    finally:
        for w in procs:
            w.stop()
        nats.stop()


def wait_members(client: PoolClient, n: int, timeout: float = 15.0) -> None:
    """Block until the client sees `n` live workers (membership arrives asynchronously over NATS)."""
    if not client.wait_for_members(lambda m: len(m) >= n, timeout):
        raise PoolUnavailable(f"fewer than {n} workers joined the cluster within {timeout} s")


def totals(stats: PoolStats) -> dict[str, int]:
    """Counters and tier fill summed over the pool, from `PoolClient.stats()` of any mode."""
    return {k: int(getattr(stats.total, k)) for k in _TOTALS}


class BenchPool:
    """`client` reaches the pool; `other_client()` is a second, independent client of the same pool.

    A kvtest instance's pool (`instance`) tells its peer how this run ended when it closes: `failure`,
    set by the suite before then, says why it failed (None: it did not); `peer_failure`, set once it
    has closed, why the peer's side of the pairing failed (None: it ended well, or there is no peer)."""

    def __init__(self, *, block_size: int, dram_bytes: int, workers: int = 0, cluster: str | None = None,
                 ssd: bool = False, instance: Instance | None = None) -> None:
        self._stack = ExitStack()
        self.url = cluster
        self.node_id = instance.worker_id if instance is not None else None
        self.failure: str | None = None
        self.peer_failure: str | None = None
        self._peer_failed: Callable[[], str | None] = lambda: None
        try:
            if instance is not None:
                self._join_instance(instance, dram_bytes)
            elif workers or cluster:
                if workers:
                    state = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-bench-"))
                    self.url = self._stack.enter_context(local_cluster(state, workers, dram_bytes=dram_bytes, ssd=ssd))
                self.where = f"{workers} local workers" if workers else f"cluster {self.url}"
                self.client = self._stack.enter_context(self._cluster_client())
                wait_members(self.client, max(workers, 1))
            else:
                self.where = "embedded pool"
                ssd_opts: dict[str, Any] = {}
                if ssd:
                    ssd_dir = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-bench-ssd-"))
                    ssd_opts = {"ssd_path": ssd_dir, "ssd_map_size": max(1 << 30, 4 * dram_bytes)}
                slab = max(block_size, min(_SLAB, dram_bytes // 4))  # a small pool still gets a few slabs
                self.client = self._stack.enter_context(PoolClient(
                    mode="embedded", dram_bytes=dram_bytes, dram_slab_size=slab, **ssd_opts))
        except BaseException:
            self._stack.close()
            raise

    def _join_instance(self, instance: Instance, dram_bytes: int) -> None:
        """kvtest multi-node mode: NATS and the instance's worker started or joined, its peer awaited."""
        self.url = self._stack.enter_context(instance_cluster(instance, dram_bytes))
        self.client = self._stack.enter_context(self._cluster_client())
        peer = wait_for_peer(self.client, instance)
        run_started(self.client, instance)
        client = self.client
        self._peer_failed = lambda: peer_failure(client, instance, peer)

        def ended(exc_type: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
            if exc_type is None:
                self.peer_failure = run_ended(client, instance, peer, self.failure)
            else:  # a failed run says so, but does not hold its peer's pool up
                run_failed(client, instance, f"{exc_type.__name__}: {exc}")
        self._stack.push(ended)
        self.where = (f"kvtest instance {instance.instance_id} ({instance.worker_id} on port {instance.listen_port}, "
                      f"peer {instance.remote_worker or 'none'})")

    def _cluster_client(self) -> PoolClient:
        return PoolClient(mode="cluster", nats_url=self.url, node_id=self.node_id)

    @contextmanager
    def other_client(self) -> Iterator[PoolClient]:
        """A separate connection to the pool (the embedded pool has only the one client: that one)."""
        if not self.url:
            yield self.client
            return
        with self._cluster_client() as client:
            wait_members(client, len(self.client.members()))
            yield client

    def peer_failed(self) -> str | None:
        """Why a kvtest instance's peer failed, as far as can be told now (None: it has not, or there is
        no peer): for a run that waits on it."""
        return self._peer_failed()

    def totals(self) -> dict[str, int]:
        return totals(self.client.stats())

    def __enter__(self) -> BenchPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.__exit__(exc_type, exc, tb)  # (not close(): a failed run's callbacks see its error)
