"""A private asyncio loop in a daemon thread, so synchronous code can use asyncio clients (nats-py),
and the one classification of nats-py's failures that core (`nats_error`) and streams translate from."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, TypeVar

from .errors import AuthError, KVPoolError, PoolTimeout, PoolUnavailable

T = TypeVar("T")

log = logging.getLogger("kvpool.aio")


class LoopThread:
    """Runs coroutines on its own event loop; `run(coro, timeout)` blocks for the result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Start `coro` on the loop without waiting for it; the future completes with it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            try:
                self.run(_cancel_all(), timeout=5)
            except Exception as e:  # a task ignoring its cancellation: the loop stops under it anyway
                log.warning("loop thread %s: tasks not cancelled within 5 s (%r); stopping it anyway",
                            self._thread.name, e)
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
    """A nats-py connection to `url` (one server, or a comma-separated list of a cluster's) that, once
    up, reconnects forever (a restarted server, or another of the cluster's, is picked up again), with
    its errors logged by `nats_error_logger`; the first connection must succeed within `timeout_s`
    seconds. `callbacks`: nats-py's, e.g. `disconnected_cb`, `reconnected_cb`."""
    import nats

    servers = [u.strip() for u in url.split(",") if u.strip()]  # a NATS cluster: any of its servers
    return await asyncio.wait_for(nats.connect(servers, connect_timeout=timeout_s, allow_reconnect=True,
                                               max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                               error_cb=nats_error_logger(log), **callbacks), timeout_s)


NatsFailure = Literal["timeout", "unavailable", "auth", "refused"]


def nats_failure(err: BaseException) -> NatsFailure | None:
    """How a NATS call failed, for the layers that translate it into their own errors (core's
    `nats_error`, streams' `_link.translate`): "timeout"; "unavailable" (no server, the connection
    closed, reconnecting or stale, JetStream not answering, a socket error); "auth" (credentials
    refused); "refused" (any other nats-py error: a bad subject, a JetStream API error); None when
    `err` is not a NATS failure."""
    import nats.errors
    import nats.js.errors

    if isinstance(err, (nats.errors.TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError,
                        TimeoutError)):
        return "timeout"
    if isinstance(err, (nats.errors.NoServersError, nats.errors.ConnectionClosedError,
                        nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError,
                        nats.errors.ConnectionDrainingError, nats.errors.OutboundBufferLimitError,
                        nats.js.errors.ServiceUnavailableError, OSError)):
        return "unavailable"
    if isinstance(err, (nats.errors.AuthorizationError, nats.errors.InvalidUserCredentialsError)):
        return "auth"
    if isinstance(err, nats.errors.Error):
        return "refused"
    return None


_CORE_ERRORS: dict[NatsFailure | None, type[KVPoolError]] = {
    "timeout": PoolTimeout, "unavailable": PoolUnavailable, "auth": AuthError, "refused": PoolUnavailable,
    None: PoolUnavailable}
"""Core's errors for NATS failures: to core, NATS is how the cluster is reached, so whatever keeps a
call from being served (an unexpected exception from nats-py included) leaves the cluster unavailable."""


def nats_error(err: BaseException, what: str) -> KVPoolError:
    """Core's one boundary for NATS: the KVPoolError to raise for `err`, met while doing `what`
    (e.g. "cannot reach the cluster at nats://..."); a KVPoolError is returned as it is."""
    if isinstance(err, KVPoolError):
        return err
    return _CORE_ERRORS[nats_failure(err)](f"{what}: {type(err).__name__}: {err}")
