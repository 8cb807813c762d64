"""Prometheus metrics of a worker: operations, bytes, latency, tier fill, evictions, connections."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .metrics_http import MetricsServer
from .stats import CacheCounters

__all__ = ["WorkerMetrics"]

log = logging.getLogger("kvpool.metrics")

_CUMULATIVE_STATS = frozenset({f.name for f in dataclasses.fields(CacheCounters)} | {"pins_refused"})
"""Cache stats that only grow while the cache is open: exported as counters (`kvpool_cache_<name>_total`,
so that `rate()` applies); the others (tier fill, blocks, leases, pins now) are gauges."""

_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.0)


class WorkerMetrics:
    """One registry per worker, so several workers can live in one process (tests)."""

    def __init__(self, cache_stats: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self._http: MetricsServer | None = None  # while serving
        self.ops = Counter("kvpool_ops", "Requests served, by operation", ["op"], registry=self.registry)
        self.bytes = Counter("kvpool_bytes", "Block bytes moved, by direction", ["direction"], registry=self.registry)
        self.latency = Histogram("kvpool_op_seconds", "Request latency in seconds, by operation", ["op"],
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.connections = Gauge("kvpool_connections", "Open client connections, by transport", ["transport"],
                                 registry=self.registry)
        self.protocol_errors = Counter("kvpool_protocol_errors", "Connections closed for malformed frames",
                                       registry=self.registry)
        self.accept_errors = Counter("kvpool_accept_errors", "Failed accepts (e.g. out of file descriptors), "
                                     "by transport; the worker retries with back-off", ["transport"],
                                     registry=self.registry)
        self.refused = Counter("kvpool_refused_connections", "Connections closed for a limit (max_connections: "
                               "the new one; max_unauthenticated: the oldest stranger; tenant_connections: a "
                               "tenant's past its share)", ["limit"],
                               registry=self.registry)
        self.deadline_closes = Counter("kvpool_deadline_closes", "Connections closed for a deadline "
                                       "(auth: not authenticated in time; io: a request not done in time)",
                                       ["deadline"], registry=self.registry)
        self.polled_requests = Counter("kvpool_polled_requests", "Requests taken by a connection's thread while "
                                       "it polled for them after answering the one before (`poll_us`), not "
                                       "woken from sleep", registry=self.registry)
        self.empty_polls = Counter("kvpool_empty_polls", "Polls for a connection's next request that found "
                                   "none within `poll_us` (that much CPU spent for nothing)", registry=self.registry)
        self.corrupt_blocks = Counter("kvpool_corrupt_blocks", "Blocks put (over TCP, or committed by a "
                                      "same-node writer) whose bytes failed their checksum (not stored)",
                                      registry=self.registry)
        self.auth_failures = Counter("kvpool_auth_failures", "Failed authentications, by kind (token: a wrong "
                                     "or missing proof over TCP, answered after a growing delay; peer_uid: a "
                                     "Unix-socket peer of another user)", ["kind"], registry=self.registry)
        self.tenant_refusals = Counter("kvpool_tenant_refusals", "Requests or blocks of a tenant's connection "
                                       "refused, by tenant and why (namespace: a key outside '<tenant>/'; "
                                       "quota: a put past its quota_bytes)", ["tenant", "why"],
                                       registry=self.registry)
        self.catch_ups = Counter("kvpool_catch_ups", "Times the worker fenced its reads and caught up from its "
                                 "peers after an absence, by cause (stall: the process did not run for over a "
                                 "second; lapse: its heartbeats lapsed past the member TTL; start: the second catch-up "
                                 "of a worker back on its kept blocks)", ["cause"],
                                 registry=self.registry)
        self.registry.register(_CacheCollector(cache_stats))

    def serve(self, host: str, port: int) -> int:
        """Serve the registry over HTTP on host:port (`metrics_http`) until `close`; the port bound."""
        self._http = MetricsServer(self.registry, host, port)
        return self._http.port

    def close(self) -> None:
        """Stop serving (the port is free again when this returns); nothing if not serving."""
        http, self._http = self._http, None
        if http is not None:
            http.close()


class _CacheCollector:
    """Exports the cache's counters (as counters) and tier fill (as gauges) at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        try:
            s = self._stats()
        except Exception as e:  # a closing cache: no sample this scrape
            log.debug("no cache sample this scrape: %r", e)
            return []
        out: list[Metric] = []
        for name, value in s.items():
            if name in _CUMULATIVE_STATS:
                out.append(CounterMetricFamily(f"kvpool_cache_{name}", f"TieredCache counter {name} (since "
                                               "the cache opened)", value=value))
            else:
                out.append(GaugeMetricFamily(f"kvpool_cache_{name}", f"TieredCache stat {name}", value=value))
        return out
