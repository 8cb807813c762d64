"""A TCP proxy that corrupts one chosen byte of the stream: a bit flip on the wire, reproducibly.

`arm(direction, skip)` makes the byte `skip` bytes into the next data crossing in `direction`
("up": client to worker, "down": worker to client) arrive inverted; everything else passes intact.
"""
from __future__ import annotations

from tcpproxy import TcpProxy


class FlipProxy(TcpProxy):
    def __init__(self, upstream: tuple[str, int]) -> None:
        self._armed: dict[str, int] = {}
        self.flipped = 0
        super().__init__(upstream)

    def arm(self, direction: str, skip: int) -> None:
        with self._lock:
            self._armed[direction] = skip

    def _passing(self, data: bytearray, direction: str) -> bytearray:
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
