"""Secrets never sit on a command line, where any user of the machine reads them (/proc/PID/cmdline):
`--token` and a `--nats-url` with a password move into the command's own environment (0400 to others)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.core.cli import _secrets_out_of_sight
from kvpool.core.client import PoolClient
from kvpool.core.errors import AuthError
from kvpool.core.nats_server import free_port


def test_secret_options_move_to_the_environment() -> None:
    argv = ["worker", "--token", "t0k", "--port", "1", "--nats-url=nats://u:pw@h:4222", "--host", "x"]
    assert _secrets_out_of_sight(argv) == (["worker", "--port", "1", "--host", "x"],
                                           {"KVPOOL_TOKEN": "t0k", "KVPOOL_NATS_URL": "nats://u:pw@h:4222"})
    plain = ["status", "--nats-url", "nats://10.0.0.1:4222", "--token=abc"]
    assert _secrets_out_of_sight(plain) == (["status", "--nats-url", "nats://10.0.0.1:4222"], {"KVPOOL_TOKEN": "abc"})
    assert _secrets_out_of_sight(["worker", "--token"]) == (["worker", "--token"], {})  # argparse says what is wrong


def test_a_worker_given_a_token_on_its_command_line_shows_it_to_nobody(tmp_path: Path) -> None:
    port, token = free_port(), "not-for-other-users-eyes"
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_TOKEN"}
    env["KVPOOL_STATE_DIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "worker", "--port", str(port), "--dram-bytes",
                             "64MiB", "--token", token], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while b"kvpool worker" not in proc.stdout.readline() and time.monotonic() < deadline:
            pass
        assert token.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # the same process, run again
        assert Path(f"/proc/{proc.pid}/environ").stat().st_mode & 0o077 == 0
        with PoolClient(mode="local", worker=f"127.0.0.1:{port}", token=token) as c:
            c.put("k", b"v")
            assert c.get("k") == b"v"  # the token still guards it
        with pytest.raises(AuthError), PoolClient(mode="local", worker=f"127.0.0.1:{port}", token="wrong") as c:
            c.get("k")
    finally:
        proc.terminate()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_errors_show_no_nats_password_or_token() -> None:
    from kvpool.core import PoolUnavailable, redacted_url
    from kvpool.core.nats_server import free_port as port

    assert redacted_url("nats://u:pw@h:1,tls://t0k@h2:2,nats://h3:3") == "nats://u:***@h:1,tls://***@h2:2,nats://h3:3"
    with pytest.raises(PoolUnavailable) as e:
        PoolClient(mode="cluster", nats_url=f"nats://kvpool:hunter2@127.0.0.1:{port()}", timeout_s=1)
    assert "hunter2" not in str(e.value) and "kvpool:***@" in str(e.value)
