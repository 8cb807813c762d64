"""The worker's Prometheus endpoint: plain HTTP, open to whoever reaches `--metrics-port` (bind it as the
README says), so it must not let strangers hold the worker's threads or descriptors.

prometheus_client's own server takes every connection on a thread of its own and waits for a request
for ever: idle connections held a thread and a descriptor each, without bound. Here a connection that
sends no whole request within `SCRAPE_TIMEOUT_S` is closed, at most `SCRAPERS` are open at once (a new one
shuts the oldest down), and a failing accept (no descriptors left) backs off instead of spinning.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import sys
import threading
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from .errors import ListenError

__all__ = ["MetricsServer", "SCRAPERS", "SCRAPE_TIMEOUT_S"]

SCRAPERS = 8
"""Connections open at once; a new one shuts the oldest down."""
SCRAPE_TIMEOUT_S = 10.0
"""How long a connection may take to send its request (and take its answer)."""
_ACCEPT_BACKOFF_S = 0.1

log = logging.getLogger("kvpool.metrics")


class _Handler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S  # set on the connection's socket: an idle scraper is closed

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would fill the worker's log


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: int) -> None:
        self.address_family = family
        self._lock = threading.Lock()
        self._open: dict[socket.socket, float] = {}  # connections served now, and since when
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError:
            time.sleep(_ACCEPT_BACKOFF_S)  # (EMFILE: readable again at once; serve_forever would spin)
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (an idle one timed out, a peer gone): closed, no traceback on stderr
        (socketserver prints one per failure: a flood, at a stranger's pace)."""
        log.debug("metrics connection from %s failed: %r", client_address, sys.exc_info()[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if len(self._open) >= SCRAPERS:  # the oldest makes room: a scraper's request takes a round trip,
                oldest = min(self._open, key=self._open.__getitem__)  # a crowd of idle ones only displace
                del self._open[oldest]  # each other (its thread ends on the shut-down socket)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self._open[request] = time.monotonic()
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)


class MetricsServer:
    """`registry` served at http://host:port/ (any path) from a thread of its own until `close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        try:
            family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            self._server = _Server((host, port), family)
        except OSError as e:
            raise ListenError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from e
        self._server.set_app(make_wsgi_app(registry))
        self.port: int = self._server.server_port
        """The port bound (the one asked for, or the free one picked for 0)."""
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="kvpool-metrics")
        self._thread.start()

    def close(self) -> None:
        """Stop serving; the port is free again when this returns."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
