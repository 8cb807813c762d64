"""cef8f66: a catch-up asks the worker at a peer's address its id first and takes another worker
answering there as no answer. The id is asked once, on the first connection: a restart at the address
between that and the CHANGES requests must fail the catch-up too (today the dropped connection fails the
next request rather than reconnecting; were a retry added, a new worker in a cluster, whose log claims
to reach back to 0, would be taken for the peer)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.core.cache import TieredCache
from kvpool.core.catch_up import catch_up
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.connection import Connection
from kvpool.core.records import WorkerInfo
from kvpool.core.server import Worker


def _worker(port: int, unix: str) -> Worker:
    return Worker(WorkerConfig(port=port, unix_path=unix),
                  CacheConfig(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False)).start()


def test_a_catch_up_refuses_another_worker_found_at_the_peers_address_on_a_reconnect(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "state"))
    unix = str(tmp_path / "w.sock")
    peer = _worker(0, unix)
    port, wid = peer.port, peer.worker_id
    workers = [peer]
    hello = Connection.hello

    def hello_then_restart(self: Connection) -> WorkerInfo:
        info = hello(self)  # the peer answers with its id ...
        workers[-1].stop()  # ... and is gone, another worker (a new id) starting at its address
        workers.append(_worker(port, unix))
        workers[-1].cache.replicas.covered_since(0)  # as a new id's start in a cluster does
        return info

    cache = TieredCache(CacheConfig(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False))
    try:
        monkeypatch.setattr(Connection, "hello", hello_then_restart)
        peers = {wid: WorkerInfo(worker_id=wid, node_id="elsewhere", tcp=peer.address)}
        ok = catch_up(cache, peers, 1, token=peer.token, node_id="here")
        monkeypatch.undo()
        assert len(workers) == 2 and workers[1].worker_id != wid
        assert not ok, f"the catch-up took worker {workers[1].worker_id}'s log for peer {wid}'s"
    finally:
        cache.close()
        workers[-1].stop()
