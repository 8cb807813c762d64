"""A TCP proxy in front of NATS that can be cut (its connections closed, new ones refused) and restored:
a worker behind it loses the cluster's control plane only, and still serves its TCP clients."""
from __future__ import annotations

import socket
import threading


class NatsCut:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self._listen.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, daemon=True, name="natscut").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            try:
                if self._cut:
                    raise OSError("cut")
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True, name="natscut-pump").start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while (data := a.recv(1 << 16)) and not self._cut:
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            s.close()

    def cut(self) -> None:
        """Close every connection through the proxy, and refuse new ones until `restore`."""
        self._cut = True
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        self._cut = False

    def close(self) -> None:
        self.cut()
        self._listen.close()
