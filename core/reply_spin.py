"""How a client waits for its worker's answers: it asks its socket, without sleeping, for up to
`spin_us` before its receive sleeps.

A receive that sleeps is woken by the worker's send, and on a VM that wake-up (an interrupt to an idle
virtual CPU) comes tens of microseconds after the send, on the path of every same-node call. A client
whose worker is about to answer polls instead (`_native.spin_readable`: a peeking, non-blocking receive,
the GIL let go), as the worker polls for a burst's next request (`WorkerConfig.poll_us`). Put loops of
64 MiB, 64 blocks a batch: 16 KiB 32.4 -> 27.2 ms, 64 KiB 13.9 -> 11.3 (docs/BENCHMARKS.md, run AV).

A connection whose spins keep finding nothing (an answer that takes long: a large batch's commit) spins
ever less often: after n empty spins in a row it lets the next 2^n - 1 chances go (n up to
`BACKOFF`), until a spin finds its answer again. `KVPOOL_SPIN_US` sets the spin for the process (0: never).
A TCP connection in clear text spins too (TCP put loops over loopback, 64 blocks a batch: 16 KiB 44.4 ->
40.3 ms per 64 MiB, 64 KiB 23.2 -> 21.5); one over TLS does not (its bytes are records, not answers), nor
does a worker's own connection to a peer (`Connection(spin=False)`), nor a client without the C extension.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable

from .errors import ConfigError

spin_readable: Callable[[int, float], bool] | None
try:
    from ._native import spin_readable
except ImportError:  # no C compiler when it was installed: receives sleep
    spin_readable = None

__all__ = ["SPIN_US", "BACKOFF", "ReplySpin", "SpinSocket", "spinning", "unix_socket"]

SPIN_US = 250.0
"""The default spin (`KVPOOL_SPIN_US`): the worker's commit of 32 blocks of 16 KiB takes ~180 µs on a
2-core VM; 100 µs missed most of them (16 KiB put loops 31.3 ms against 27.2 with 250 µs, no spin 32.4)."""
BACKOFF = 6
"""After n empty spins in a row (n at most this), the next 2^n - 1 waits sleep at once."""


def spin_us_from_env() -> float:
    """`KVPOOL_SPIN_US` (microseconds, 0 to 10000), else `SPIN_US`; ConfigError for anything else."""
    raw = os.environ.get("KVPOOL_SPIN_US")
    if raw is None or raw == "":
        return SPIN_US
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"KVPOOL_SPIN_US={raw!r}: a number of microseconds from 0 to 10000") from None
    if not 0 <= value <= 10_000:
        raise ConfigError(f"KVPOOL_SPIN_US={raw!r}: a number of microseconds from 0 to 10000", limit=10_000)
    return value


class ReplySpin:
    """One connection's spins (see the module's doc); `wait` before each answer's first bytes."""

    __slots__ = ("spin_us", "_misses", "_skips")

    def __init__(self, spin_us: float) -> None:
        self.spin_us = spin_us
        self._misses = 0  # empty spins in a row
        self._skips = 0  # waits left that sleep at once

    def wait(self, sock: socket.socket) -> None:
        """Return once `sock` has something to read (or its peer closed it), or once the spin is over:
        the caller's receive then sleeps for what is left. The spin is no longer than the socket's
        timeout; a closed socket is left to the receive to report."""
        if self._skips:
            self._skips -= 1
            return
        fd, timeout = sock.fileno(), sock.gettimeout()
        spin_us = self.spin_us if timeout is None else min(self.spin_us, timeout * 1e6)
        if fd < 0 or spin_us <= 0:
            return
        assert spin_readable is not None  # (no SpinSocket is made without it)
        if spin_readable(fd, spin_us):
            self._misses = 0
            return
        self._misses = min(self._misses + 1, BACKOFF)
        self._skips = (1 << self._misses) - 1


class SpinSocket(socket.socket):
    """A client's socket to a worker (Unix, or TCP in clear text), whose receives of an answer spin first
    (`spin`, read by `protocol.recv_frame`)."""

    __slots__ = ("spin",)

    def __init__(self, family: int = socket.AF_UNIX, type: int = socket.SOCK_STREAM, proto: int = 0,
                 fileno: int | None = None, *, spin_us: float = SPIN_US) -> None:
        # (socket.socket's own signature first: its `dup` makes one of this class with it)
        self.spin = ReplySpin(spin_us)  # (first: once the socket holds `fileno`, nothing after it can fail)
        super().__init__(family, type, proto, fileno)

    def dup(self) -> SpinSocket:
        """`socket.dup`, the copy spinning as long as this one."""
        twin = super().dup()
        twin.spin = ReplySpin(self.spin.spin_us)
        return twin


def unix_socket(spin: bool = True) -> socket.socket:
    """A new Unix stream socket for a client: a SpinSocket where it spins (`spin`, `KVPOOL_SPIN_US` > 0,
    the C extension built), else a plain one (`spin` False: the setting is not read)."""
    if spin and spin_readable is not None:
        spin_us = spin_us_from_env()
        if spin_us > 0:
            return SpinSocket(spin_us=spin_us)
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)


def spinning(sock: socket.socket, timeout_s: float, spin_us: float) -> socket.socket:
    """A connected TCP socket as a SpinSocket of `spin_us` on the same descriptor (its timeout
    `timeout_s`), where the C extension is built; else `sock` itself. The descriptor is owned throughout:
    closed if the SpinSocket cannot be made."""
    if spin_readable is None:
        return sock
    fd = -1
    try:
        fd = sock.detach()
        spun = SpinSocket(sock.family, sock.type, sock.proto, fd, spin_us=spin_us)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    spun.settimeout(timeout_s)  # (the descriptor's blocking mode and the object's timeout agree again)
    return spun
