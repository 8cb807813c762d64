"""A TCP proxy for fault tests: everything passes through it, until `cut()` closes its connections and
refuses new ones (a worker behind it loses NATS only, say, and still serves its own TCP clients), and
`restore()` lets them through again. Subclasses may change the bytes on their way (`_passing`)."""
from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listen.getsockname()[1]}"
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._cut = False
        threading.Thread(target=self._accept, daemon=True, name=type(self).__name__.lower()).start()

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
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while (data := src.recv(1 << 16)) and not self._cut:
                dst.sendall(self._passing(bytearray(data), direction))
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _passing(self, data: bytearray, direction: str) -> bytearray:
        """The bytes crossing in `direction` ("up": client to server, "down": back), as they arrive."""
        return data

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
