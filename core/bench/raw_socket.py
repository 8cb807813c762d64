"""The raw-socket baseline: a process that receives or sends N bytes with plain sendall/recv_into.

`server()` runs `serve(PORT)` in a child Python (by hand: `python -m kvpool.core.bench.raw_socket PORT
[HOST]`). Each request is 9 bytes: op (b"P" to receive N bytes then answer one byte, b"G" to send N
bytes) and N as u64.
"""
from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ..errors import BenchError
from ..nats_server import die_with_parent, free_port

__all__ = ["server", "serve", "put", "get"]


@contextmanager
def server(timeout: float = 20.0) -> Iterator[int]:
    """The baseline in a child process (its own core, like a worker); yields its port once it listens."""
    port = free_port()
    # (not `-m` of this module: the package imports it first, and runpy warns that it runs it again)
    proc = subprocess.Popen([sys.executable, "-c", f"from kvpool.core.bench.raw_socket import serve; serve({port})"],
                            preexec_fn=die_with_parent())  # (gone with this process, however it ends)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BenchError(f"baseline server on port {port} did not start") from None
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait()


def serve(port: int, host: str = "127.0.0.1") -> None:
    srv = socket.create_server((host, port))
    buf = np.ones(1 << 30, dtype=np.uint8)  # touched once: no page faults while timed
    view = buf.data
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = bytearray(9)
                if conn.recv_into(head, 9, socket.MSG_WAITALL) < 9:
                    break
                op, n = struct.unpack("<cQ", head)
                if op == b"P":
                    got = 0
                    while got < n:
                        k = conn.recv_into(view[got:n], n - got)
                        if k == 0:
                            return
                        got += k
                    conn.sendall(b"k")
                else:
                    conn.sendall(view[:n])


def put(sock: socket.socket, views: list[memoryview]) -> None:
    sock.sendall(struct.pack("<cQ", b"P", sum(len(v) for v in views)))
    for v in views:
        sock.sendall(v)
    sock.recv(1)


def get(sock: socket.socket, views: list[memoryview]) -> None:
    sock.sendall(struct.pack("<cQ", b"G", sum(len(v) for v in views)))
    for v in views:
        got, n = 0, len(v)
        while got < n:
            got += sock.recv_into(v[got:], n - got)


if __name__ == "__main__":
    serve(int(sys.argv[1]), *sys.argv[2:3])
