"""A worker with tenants and raw sockets to it, for checks that speak `kvpool.core.protocol` frames
themselves (tests/security/test_adv_same_node.py, test_review_seventh.py)."""
from __future__ import annotations

import json
import socket
from pathlib import Path

from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.server import Worker
from kvpool.core.transport import TcpTransport

POOL = "the-pool-token-" + "p" * 40
A_TOKEN = "tenant-a-token-" + "a" * 32
B_TOKEN = "tenant-b-token-" + "b" * 32
MIB = 1 << 20
SMALL = {"dram_bytes": 32 * MIB, "dram_slab_size": MIB, "prefault": False}


def tenants_file(tmp_path: Path, table: dict[str, dict[str, object]]) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(table))
    path.chmod(0o600)
    return str(path)


def tenant_worker(tmp_path: Path, table: dict[str, dict[str, object]] | None = None, **config: object) -> Worker:
    """A worker with the pool token and tenants (default `a`, `b`, no quotas) on a 32 MiB arena of 1 MiB
    slabs: max_block 1 MiB, max_reserve 4 MiB."""
    table = table or {"a": {"token": A_TOKEN}, "b": {"token": B_TOKEN}}
    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), token=POOL,  # type: ignore[arg-type]
                               tenants_file=tenants_file(tmp_path, table), **config), CacheConfig(**SMALL)).start()


def unix_socket(w: Worker) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(w.unix_path)
    return s


def tcp_socket(w: Worker, token: str) -> socket.socket:
    """A raw TCP socket authenticated with `token`, as any client does it."""
    s = socket.create_connection(("127.0.0.1", w.port), timeout=10)
    t = TcpTransport(w.address, token=token)
    try:
        t._handshake(s)
    except BaseException:
        s.close()
        raise
    finally:
        t.close()
    return s
