"""Worker processes started from Python: used by `kvpool bench`, the tests and the fault suite."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .auth import token_path
from .cli import PARENT_ENV
from .errors import PoolTimeout, PoolUnavailable
from .nats_server import free_port
from .tiers.dram import arena_names

__all__ = ["WorkerProcess"]

log = logging.getLogger("kvpool.procs")

_READY_LINE = "kvpool worker "
"""How `kvpool worker` starts the line it prints once it serves (core/cli.py)."""


class WorkerProcess:
    """`kvpool worker` in a child process with its own state dir; `stop()` is SIGTERM (then SIGABRT,
    which leaves the stuck worker's stacks in `log_path`), `kill()` -9. The worker stops by itself
    within a second of this process's end, if this process never stopped it (`cli.PARENT_ENV`)."""

    def __init__(self, state_dir: str | os.PathLike[str], *, nats_url: str | None = None,
                 dram_bytes: str = "256MiB", ssd: bool = False, node_id: str | None = None,
                 extra: list[str] | None = None, env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.unix_path = str(self.state_dir / f"worker-{self.port}.sock")
        args = [sys.executable, "-m", "kvpool.core.cli", "worker", "--port", str(self.port),
                "--dram-bytes", dram_bytes]
        if nats_url:
            args += ["--nats-url", nats_url]
        if ssd:
            args += ["--ssd-path", str(self.state_dir / "ssd"), "--ssd-map-size", "1GiB"]
        args += extra or []
        # The worker's token file is this process's (KVPOOL_TOKEN_FILE, else its own state dir's): clients
        # here find the token the worker makes, though the worker keeps the rest of its state apart.
        child_env = {**os.environ, "KVPOOL_STATE_DIR": str(self.state_dir), "KVPOOL_TOKEN_FILE": str(token_path()),
                     PARENT_ENV: str(os.getpid()), **(env or {})}  # it stops once we are gone, however we went
        if node_id:
            child_env["KVPOOL_NODE_ID"] = node_id
        self.log_path = self.state_dir / f"worker-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the worker's output, for its lifetime (closed in stop)
        self.proc = subprocess.Popen(args, env=child_env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        """Wait until the worker serves and has registered in its cluster: it prints its ready line
        only after both (its sockets listen, and are connectable, earlier than that)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._exited()
                raise PoolUnavailable(f"worker exited with {self.proc.returncode}: {self.log_tail(2000)}")
            if _READY_LINE in self.log_tail(1 << 16) and os.path.exists(self.unix_path):
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                    return self
                except OSError:
                    pass
            time.sleep(0.05)
        self.kill()
        raise PoolTimeout(f"worker on port {self.port} not ready within {timeout} s", limit=timeout)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # SIGABRT first: the worker's faulthandler writes every thread's stack to its log
                self.proc.send_signal(signal.SIGABRT)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                log.warning("worker on port %d did not stop within %s s of SIGTERM; its output:\n%s", self.port,
                            timeout, self.log_tail(6000))
        self._exited()
        return int(self.proc.returncode)

    def log_tail(self, n: int = 3000) -> str:
        """The end of the worker's output: what a failed check should show."""
        return self.log_path.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._exited()

    def _exited(self) -> None:
        """Close the log and remove the arenas a killed worker could not unlink itself."""
        self._log.close()
        for name in arena_names(self.proc.pid):
            os.unlink(f"/dev/shm/{name}")
