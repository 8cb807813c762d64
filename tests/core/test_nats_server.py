"""The nats-server kvpool starts (`kvpool up`, the benches, the tests): the environment it runs in, and the
free ports it is given."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpool.core.nats_server import NatsServer, free_port, server_env


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_a_started_server_runs_on_half_the_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    server = NatsServer(tmp_path / "nats", port=0).start()
    try:
        assert server.proc is not None
        want = max(1, len(os.sched_getaffinity(0)) // 2)
        assert _environ(server.proc.pid)["GOMAXPROCS"] == str(want)
    finally:
        server.stop()


def test_a_gomaxprocs_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMAXPROCS", "7")
    assert server_env()["GOMAXPROCS"] == "7"


def test_one_cpu_still_gets_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert server_env()["GOMAXPROCS"] == "1"


def test_free_port_never_gives_a_port_twice() -> None:
    """The kernel hands a released port out again (2000 binds to port 0 here repeated about 140 ports):
    a CI run once gave a kvtest instance's worker and the nats-server the same port, and both failed."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
