"""A thread that calls its owner back at a deadline: what a writer holds back to send with the next
thing it writes (a stager's commits, a producer's announcements) goes out there if the writer does not
come back before."""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["Flusher"]

log = logging.getLogger("kvpool.client")


class Flusher:
    """Calls `flush` at the time last `arm`ed, in a thread named `name`. Lives until `stop`, or until
    the owner of `flush` is gone (it holds it weakly: an owner dropped unclosed is collected, and what it
    holds with it); the owner stops it when it closes (`weakref.finalize(owner, flusher.stop, False)` for
    one dropped unclosed)."""

    def __init__(self, flush: weakref.WeakMethod[Callable[[], None]], name: str) -> None:
        self._flush = flush
        self._cond = threading.Condition()
        self._when: float | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, when: float) -> None:
        """Call `flush` at `when` (time.monotonic), in place of the time set before. A later time does not
        wake the thread: it sees it when the earlier one comes, and waits on."""
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
                except Exception:  # a bug: the thread stays for the next deadline
                    log.exception("%s: sending what was held failed", self._thread.name)
                finally:
                    self._cond.acquire()

    def _call(self) -> bool:
        """The owner's `flush` (False: the owner is gone), its reference held for the call only."""
        flush = self._flush()
        if flush is None:
            return False
        flush()
        return True

    def stop(self, wait: bool = True) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
