"""A private asyncio loop in a daemon thread, so synchronous code can use asyncio clients (nats-py)."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines on its own event loop; `run(coro, timeout)` blocks for the result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> "asyncio.Future[Any]":
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[return-value]

    def stop(self) -> None:
        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            try:
                self.run(_cancel_all(), timeout=5)
            except Exception:
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()


def nats_error_logger(log: logging.Logger) -> Callable[[Exception], Awaitable[None]]:
    """An `error_cb` for nats-py: one warning line per change of error. Its default logs a full
    traceback on every reconnect attempt (twice a second while a server is down)."""
    last = ""

    async def on_error(e: Exception) -> None:
        nonlocal last
        line = f"{type(e).__name__}: {e}"
        if line != last:
            log.warning("nats: %s", line)
            last = line

    return on_error


async def nats_connect(url: str, timeout_s: float, log: logging.Logger, **callbacks: Any) -> Any:
    """A nats-py connection that, once up, reconnects forever (a restarted server is picked up again),
    with its errors logged by `nats_error_logger`; the first connection must succeed within
    `timeout_s` seconds. `callbacks`: nats-py's, e.g. `disconnected_cb`, `reconnected_cb`."""
    import nats

    return await asyncio.wait_for(nats.connect(url, connect_timeout=timeout_s, allow_reconnect=True,
                                               max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                               error_cb=nats_error_logger(log), **callbacks), timeout_s)
