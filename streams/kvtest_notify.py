"""kvtest's notifications across instances (`kvpool bench cache`, which loads this module by path
through `kvpool.core.bench.notify`): the writer announces each batch of blocks it created on a
kvpool stream; readers on other nodes receive the announcements and read the announced blocks at once,
which checks that what one node wrote is visible from another as soon as it is announced.

Stream `kvtest-<namespace>` (an hour of retention), one inline message per created batch:
`{"run": run id, "keys": [...], "t": wall-clock seconds at publish}`.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
import time
from typing import Any

from kvpool.core.bench import percentiles_us

from . import Consumer, Producer, StreamConfig, StreamError, create_stream

log = logging.getLogger("kvpool.streams")


def stream_name(namespace: str) -> str:
    return "kvtest-" + re.sub(r"[^A-Za-z0-9_-]", "_", namespace)[:56]


class Notifier:
    """The writer's side: `announce(run, keys)` after each put."""

    def __init__(self, nats_url: str, namespace: str) -> None:
        self.stream = stream_name(namespace)
        create_stream(nats_url, self.stream, StreamConfig(max_age_s=3600))
        self._producer = Producer(self.stream, nats_url)
        self.sent = 0

    def announce(self, run: str, keys: list[str]) -> None:
        self._producer.publish({"run": run, "keys": keys, "t": time.time()})
        self.sent += 1

    def close(self) -> None:
        self._producer.close()


class NotifyReader:
    """The reader's side: a thread receives announcements of `run` from now on; `take()` hands out
    the announced keys not yet read; `metrics()` sums them up (latency: publish to receipt)."""

    def __init__(self, nats_url: str, namespace: str) -> None:
        create_stream(nats_url, stream_name(namespace), StreamConfig(max_age_s=3600))  # the writer may come later
        self._consumer = Consumer(stream_name(namespace), nats_url, start="new")
        self._keys: queue.Queue[str] = queue.Queue()
        self.run: str | None = None
        self.received = self.keys = 0
        self.latency_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtest-notify", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.receive(0.2)
            if msg is None:
                continue
            try:
                body: dict[str, Any] = msg.json()
                run, t, keys = body.get("run"), float(body["t"]), [str(k) for k in body["keys"]]
            except (StreamError, ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or not ours
                log.warning("kvtest notifications: message %d is not an announcement: %s", msg.seq, e)
                msg.term()
                continue
            msg.ack()
            if self.run is not None and run != self.run:
                continue  # an earlier writer's run in the same namespace
            self.latency_s.append(max(0.0, time.time() - t))
            self.received += 1
            for k in keys:
                self._keys.put(k)
                self.keys += 1

    def take(self, n: int) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            try:
                out.append(self._keys.get_nowait())
            except queue.Empty:
                break
        return out

    def metrics(self) -> dict[str, Any]:
        lat = percentiles_us(self.latency_s)
        return {"notifications": self.received, "notified_keys": self.keys,
                "notify_p50_ms": round(lat["p50"] / 1e3, 3), "notify_p99_ms": round(lat["p99"] / 1e3, 3)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()
