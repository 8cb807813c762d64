"""The command line reports a KVPoolError (refused credentials, a bad option, an unreachable worker) as one
line on stderr, `kvpool <command>: <ErrorType>: <message>`, and exit status 2; never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core.cli import EXIT_ERROR
from kvpool.core.nats_creds import authorization, ensure_creds
from kvpool.core.nats_server import NatsServer, free_port


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[NatsServer]:
    users = authorization(ensure_creds(tmp_path / "creds"))
    server = NatsServer(tmp_path / "nats", port=0, authorization=users).start()
    yield server
    server.stop()


def _kvpool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVPOOL_STATE_DIR": str(tmp_path / "state")}  # no credentials or token of ours there
    return subprocess.run([sys.executable, "-m", "kvpool.core.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def _one_line(done: subprocess.CompletedProcess[str], command: str, error: str) -> str:
    assert done.returncode == EXIT_ERROR == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("kvpool ")]
    assert len(lines) == 1 and lines[0].startswith(f"kvpool {command}: {error}: "), done.stderr
    return lines[0]


def test_refused_credentials_are_one_line(secured: NatsServer, tmp_path: Path) -> None:
    line = _one_line(_kvpool(tmp_path, "status", "--nats-url", secured.url), "status", "AuthError")
    assert "without credentials" in line
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"user": "kvpool-client", "password": "not-it"}')
    wrong.chmod(0o600)  # (a credentials file others may read is refused before it is tried)
    line = _one_line(_kvpool(tmp_path, "status", "--nats-url", secured.url, "--nats-creds", str(wrong)),
                     "status", "AuthError")
    assert str(wrong) in line


def test_bad_options_and_unreachable_pools_are_one_line(tmp_path: Path) -> None:
    line = _one_line(_kvpool(tmp_path, "worker", "--port", "0", "--tls-cert", str(tmp_path / "cert.pem")),
                     "worker", "ConfigError")
    assert "both a certificate and its key" in line
    _one_line(_kvpool(tmp_path, "worker", "--host", "10.255.255.1", "--port", "0", "--token", "t" * 32),
              "worker", "ListenError")
    _one_line(_kvpool(tmp_path, "status", "--nats-url", f"nats://127.0.0.1:{free_port()}"), "status",
              "PoolUnavailable")
