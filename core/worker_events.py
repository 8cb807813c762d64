"""A worker's block-event publishing: its cache's changes to NATS (`--events`) and/or vLLM's ZMQ
format (`--events-zmq ENDPOINT`), set up from its `WorkerConfig` and closed with it."""
from __future__ import annotations

from typing import Any

from .errors import ConfigError
from .events import EventPublisher, NatsSink, Sink
from .events_zmq import VllmFormat, ZmqSink

__all__ = ["WorkerEvents"]


class WorkerEvents:
    """Starts publishing on construction (raising, with nothing left open, if a sink cannot start)."""

    def __init__(self, worker: Any) -> None:
        cfg = worker.config
        self._sinks: list[Any] = []
        try:
            if cfg.events:
                if not cfg.nats_url:
                    raise ConfigError("events on NATS (--events) need the worker in a cluster (--nats-url)")
                self._sinks.append(NatsSink(cfg.nats_url, worker.worker_id, creds=cfg.nats_credentials()))
            if cfg.events_zmq:
                fmt = VllmFormat(cfg.events_layout, cfg.events_block_hash, cfg.events_block_tokens)
                self._sinks.append(ZmqSink(cfg.events_zmq, fmt))
            sinks: list[Sink] = list(self._sinks)
            self.publisher = EventPublisher(worker.cache, worker.worker_id, worker.node_id, sinks)
        except BaseException:
            self._close_sinks()
            raise

    def close(self) -> None:
        """Publish what is queued and take back what goes with the process (`cleared`, then what the
        SSD tier keeps: its DRAM copies go, a worker without SSD keeps nothing), then close the sinks.
        Call it after the stop's flush to SSD and before the cache closes."""
        self.publisher.close(going=True)
        self._close_sinks()

    def _close_sinks(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks.clear()
