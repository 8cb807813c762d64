"""Since when a worker may hold the blocks it holds, which clients need to tell it of later writes.

A worker holds a key's block only if it owned the key, for some writer, at some moment since it began
to hold what it holds. A client that writes the key to workers ranked above it then tells it to drop
its copy when it may have owned the key since (`kvpool.core.succession`). That moment is told in the
worker's member entry as `held_since` (`WorkerInfo`): the wall time of the last heartbeat at which it
held no block, so it costs nothing per put. A worker that starts on the blocks of an earlier run keeps
the time that run began to hold them, in a file beside its state; without that file, 0 (forever). One
without an SSD tier starts with nothing, so it keeps no file (its `path` is None).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

from .auth import write_private

__all__ = ["HeldSince"]

log = logging.getLogger("kvpool.worker")


class HeldSince:
    """`now(holds)`: since when (unix s) the blocks held now may have been taken; `holds`: whether the
    worker holds any block (now; at start, for the blocks of an earlier run). `path` keeps the time
    across restarts; None where nothing outlives the worker (its blocks held at start are then taken as
    held forever)."""

    def __init__(self, path: Path | None, holds: bool) -> None:
        self.path = path
        self._since: float | None = self._read() if holds else None  # None while it holds nothing
        self._empty_at = time.time()  # the last time told while nothing was held
        self._lock = threading.Lock()  # (heartbeats and HELLO replies call `now` from their threads)

    def now(self, holds: bool) -> float:
        """The time to tell (each heartbeat): now while nothing is held; else the last such time."""
        with self._lock:
            t = time.time()
            if not holds:
                self._since, self._empty_at = None, t
                return t
            if self._since is None:  # held nothing at the last call: what it holds came after it
                self._since = self._empty_at
                self._write(self._since)
            return self._since

    def _read(self) -> float:
        if self.path is None:
            return 0.0
        try:
            return float(self.path.read_text().strip())
        except FileNotFoundError:
            return 0.0
        except (OSError, ValueError) as e:
            log.warning("unreadable held-since stamp %s (%s): its blocks are taken as held forever", self.path, e)
            return 0.0

    def _write(self, since: float) -> None:
        if self.path is None:
            return
        try:
            write_private(self.path, f"{math.floor(since * 1000) / 1000:.3f}\n")  # (never later)
        except OSError as e:  # a restart then takes its blocks as held forever: more is told, never less
            log.debug("held-since stamp %s not written: %s", self.path, e)
