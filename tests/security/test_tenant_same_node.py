"""A tenant on a worker's own node, given its own Unix user (as the README advises): its cluster client
sees the worker's Unix socket, may not use it (0600, another user's), and so reaches the worker over
TCP with its tenant token, bound to its namespace, instead of treating the worker as absent."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from workerhelp import as_nobody, need_root, open_folder

from kvpool.core.auth import unix_socket_usable
from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.nats_server import NatsServer
from kvpool.core.server import Worker

A_TOKEN = "tenant-a-token-" + "a" * 32
SMALL = {"dram_bytes": 32 << 20, "dram_slab_size": 1 << 20, "prefault": False}


@pytest.fixture
def worker(nats: NatsServer, tmp_path: Path) -> Iterator[Worker]:
    """A cluster worker with tenant `a`, its Unix socket in a folder anyone may enter (so another user
    sees the socket, which only its own 0600 mode and SO_PEERCRED protect)."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"a": {"token": A_TOKEN}}))
    tenants.chmod(0o600)
    with open_folder() as folder:
        w = Worker(WorkerConfig(port=0, unix_path=str(folder / "worker.sock"), nats_url=nats.url,
                                tenants_file=str(tenants), heartbeat_s=0.5), CacheConfig(**SMALL)).start()
        try:
            yield w
        finally:
            w.stop()


def test_tenant_of_another_user_falls_back_to_tcp(worker: Worker, nats: NatsServer) -> None:
    need_root()
    assert unix_socket_usable(worker.unix_path)  # this user (root) may use it
    got = as_nobody("""
        import pkgutil  # what nats-py imports lazily, loaded while the files are readable
        import nats.aio.client, nats.errors, nats.js, nats.js.errors, nats.js.kv
        from kvpool.core.auth import unix_socket_usable
        from kvpool.core.client import PoolClient
        from kvpool.core.errors import NamespaceError
    """, """
        out = {"sees_socket": os.path.exists(sys.argv[2]), "usable": unix_socket_usable(sys.argv[2])}
        with PoolClient(mode="cluster", nats_url=sys.argv[1], token=sys.argv[3], timeout_s=5) as c:
            assert c.wait_for_members(lambda m: len(m) == 1, 15)
            c.put("a/mine", b"tenant a's bytes")
            out["get"] = c.get("a/mine").decode()
            try:
                c.get("shared/key")
                out["outside"] = "read"
            except NamespaceError:
                out["outside"] = "NamespaceError"
            out["transports"] = sorted(type(t).__name__ for t in c.backend.fanout.connected().values())
        print(json.dumps(out))
    """, nats.url, worker.unix_path, A_TOKEN)
    assert got == {"sees_socket": True, "usable": False, "get": "tenant a's bytes", "outside": "NamespaceError",
                   "transports": ["TcpTransport"]}
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=5) as c:  # this user's client: shared memory
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        assert c.get("a/mine") == b"tenant a's bytes"
        assert [type(t).__name__ for t in c.backend.fanout.connected().values()] == ["ShmTransport"]
