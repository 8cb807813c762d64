"""A TCP proxy that corrupts one chosen byte of the stream: a bit flip on the wire, reproducibly.

`arm(direction, skip)` makes the byte `skip` bytes into the next data crossing in `direction`
("up": client to worker, "down": worker to client) arrive inverted; everything else passes intact.
"""
from __future__ import annotations

import socket
import threading


class FlipProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listen.getsockname()[1]}"
        self._armed: dict[str, int] = {}
        self.flipped = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="flipproxy").start()

    def arm(self, direction: str, skip: int) -> None:
        with self._lock:
            self._armed[direction] = skip

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._socks += [client, server]
            for src, dst, direction in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while data := src.recv(1 << 16):
                data = self._maybe_flip(bytearray(data), direction)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _maybe_flip(self, data: bytearray, direction: str) -> bytearray:
        with self._lock:
            skip = self._armed.get(direction)
            if skip is None:
                return data
            if skip < len(data):
                data[skip] ^= 0xFF
                del self._armed[direction]
                self.flipped += 1
            else:
                self._armed[direction] = skip - len(data)
        return data

    def close(self) -> None:
        self._listen.close()
        for s in self._socks:
            s.close()
