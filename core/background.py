"""`Background`: one thread for work a caller need not wait for (a cluster client's read repairs, its
notes to the workers below a key's owners), with a bound on what may wait. `Alarm`: a thread that calls
back at a time its owner sets (a stager's held commits, a producer's held announcements)."""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Alarm", "Background"]

log = logging.getLogger("kvpool.client")


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


class Alarm:
    """A thread that calls its owner's method at the time last set by `arm`, should the owner not have
    done the work itself before (the method finds nothing to do then). Lives until `stop`, or until the
    owner is gone: it holds the method weakly, so an owner dropped unclosed is collected (and what it
    holds released) with its alarm's thread ending after."""

    def __init__(self, call: weakref.WeakMethod[Callable[[], None]], name: str, what: str) -> None:
        self._method = call
        self._what = what  # (for the log of a failure: "sending held commits")
        self._cond = threading.Condition()
        self._when: float | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, when: float) -> None:
        """Call at `when` (time.monotonic), in place of the time set before. A later time does not wake
        the thread: it sees it when the earlier one comes, and waits on."""
        with self._cond:
            earlier = self._when is None or when < self._when
            self._when = when
            if earlier:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                left = None if self._when is None else self._when - time.monotonic()
                if left is None or left > 0:
                    self._cond.wait(left)
                    continue
                self._when = None
                self._cond.release()
                try:
                    if not self._call():
                        return  # (the owner is gone; `finally` takes the condition back for the `with`)
                except Exception:  # a bug: the thread stays for the next time
                    log.exception("%s failed", self._what)
                finally:
                    self._cond.acquire()

    def _call(self) -> bool:
        """The owner's method (False: the owner is gone), its reference held for the call only."""
        method = self._method()
        if method is None:
            return False
        method()
        return True

    def stop(self, wait: bool = True) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
