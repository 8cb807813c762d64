"""`Background`: one thread for work a caller need not wait for (a cluster client's read repairs, its
notes to the workers below a key's owners), with a bound on what may wait."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Background"]


class Background:
    """Runs jobs in one thread, in order. Each job weighs `n` (its keys); at most `max_pending` wait:
    `submit` says whether it took the job, so that the caller decides what a full (or closed) queue
    means: skip it, or do it itself."""

    def __init__(self, name: str, max_pending: int) -> None:
        self.max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, n: int, job: Callable[[], None]) -> bool:
        with self._lock:
            if self._pending + n > self.max_pending:
                return False
            self._pending += n

        def run() -> None:
            try:
                job()
            finally:
                with self._lock:
                    self._pending -= n

        try:
            self._pool.submit(run)
        except RuntimeError:  # closed
            with self._lock:
                self._pending -= n
            return False
        return True

    def wait(self) -> None:
        """Until the jobs submitted so far are done (tests, shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self, flush: bool = False) -> None:
        """Wait for the job under way (make it fail fast first), and with `flush` for those not begun;
        without, they are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=not flush)
