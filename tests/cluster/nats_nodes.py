"""A three-node NATS cluster with JetStream on loopback addresses, and a TCP relay in front of a node
whose cable can be cut (it stops passing bytes both ways and closes nothing, as a pulled cable does)."""
from __future__ import annotations

import selectors
import socket
import subprocess
import threading
import time
from pathlib import Path

from kvpool.core.nats_server import binary, cluster_config, free_port

HOSTS = ("127.0.0.21", "127.0.0.22", "127.0.0.23")


class ThreeNodes:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port, self.cluster_port = free_port(HOSTS[0]), free_port(HOSTS[0])
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return ",".join(f"nats://{h}:{self.port}" for h in HOSTS)

    def start(self, i: int) -> None:
        conf = self.workdir / f"nats-{i}.conf"
        conf.write_text(cluster_config(f"n{i}", HOSTS[i], list(HOSTS), str(self.workdir / f"js-{i}"),
                                       port=self.port, cluster_port=self.cluster_port))
        self.procs.append(subprocess.Popen([binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))

    def wait_listening(self, i: int) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((HOSTS[i], self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, f"nats node {i} does not listen"
                time.sleep(0.05)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(10)


class Relay:
    """Passes TCP connections to `url` (a free port on 127.0.0.1) on to `target` until `cut()`: from then
    on no byte goes either way, nothing is closed, and new connections are accepted and left unanswered."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._held: list[socket.socket] = []
        self.carried = 0  # connections passed on
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self._cut.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if sock.fileno() < 0 or (self._cut.is_set() and sock is not self._listener):
                    continue  # (closed with its pair's other end in this round)
                if sock is self._listener:
                    conn, _ = sock.accept()
                    self._held.append(conn)
                    if not self._cut.is_set():
                        upstream = socket.create_connection(self.target)
                        self._held.append(upstream)
                        self._sel.register(conn, selectors.EVENT_READ, upstream)
                        self._sel.register(upstream, selectors.EVENT_READ, conn)
                        self.carried += 1
                    continue
                try:
                    data = sock.recv(1 << 16)
                    if data:
                        key.data.sendall(data)
                except OSError:  # reset by one side
                    data = b""
                if not data:  # one side closed: close both
                    for s in (sock, key.data):
                        self._sel.unregister(s)
                        s.close()
            if self._cut.is_set():
                time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sel.close()
        for s in [self._listener, *self._held]:
            s.close()
