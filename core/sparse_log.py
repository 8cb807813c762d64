"""`SparseLog`: warnings of one kind at most once a while, so that a crowd (strangers, failed logins)
cannot flood a log."""
from __future__ import annotations

import logging
import threading
import time

__all__ = ["SparseLog"]


class SparseLog:
    """Warnings of one kind at most one per `every_s` seconds, the rest at debug level and counted in the
    next warning: a crowd of strangers the worker shuts (displaced, late to authenticate) must not
    flood its log."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0) -> None:
        self._log, self._every_s = logger, every_s
        self._lock = threading.Lock()
        self._last = -every_s
        self._skipped = 0

    def log(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            due = now - self._last >= self._every_s
            skipped = self._skipped if due else 0
            self._last, self._skipped = (now, 0) if due else (self._last, self._skipped + 1)
        if not due:
            self._log.debug(msg, *args)
        elif skipped:
            self._log.warning(msg + " (and %d more like it since the last such warning, at debug level)",
                              *args, skipped)
        else:
            self._log.warning(msg, *args)
