"""A private asyncio loop in a daemon thread, so synchronous code can use asyncio clients (nats-py),
and the one classification of nats-py's failures that core (`nats_error`) and streams translate from."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, TypeVar

from .errors import AuthError, KVPoolError, PoolTimeout, PoolUnavailable
from .nats_creds import NatsCreds, Role, creds_path, find_creds, redacted_url

__all__ = ["LoopThread", "nats_error_logger", "PING_INTERVAL_S", "MAX_OUTSTANDING_PINGS", "CONNECT_ATTEMPT_S",
    "nats_connect", "nats_denied", "NatsFailure", "nats_failure", "nats_error"]

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

    def shut(self, last: Callable[[], Coroutine[Any, Any, Any]] | None = None, timeout: float = 5.0) -> None:
        """Run `last()` on the loop (e.g. a connection's `close`; a failure, or one past `timeout`
        seconds, is logged: leaving anyway), then `stop`. Safe from any thread, as a finalizer needs (a
        collection runs it wherever it happens): on the loop's own thread, which cannot wait for
        itself, a short thread of its own does it."""
        if threading.current_thread() is self._thread:
            threading.Thread(target=self.shut, args=(last, timeout), name=f"{self._thread.name}-shut",
                             daemon=True).start()
            return
        if last is not None and not self.loop.is_closed():
            try:
                self.run(last(), timeout)
            except Exception as e:  # a server gone, or a closed connection: nothing left to release
                log.debug("loop thread %s: %r while shutting it", self._thread.name, e)
        self.stop()

    def stop(self) -> None:
        """Cancel the loop's tasks, stop it and close it (waiting up to 5 s for each)."""
        if threading.current_thread() is self._thread:  # (it cannot wait for itself: see `shut`)
            self.shut()
            return

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


_WARNED: dict[tuple[str, str], float] = {}
"""When each (logger, nats error line) was last logged as a warning."""
_REPEAT_S = 60.0


def nats_error_logger(log: logging.Logger) -> Callable[[Exception], Awaitable[None]]:
    """An `error_cb` for nats-py: one warning line per change of error. Its default logs a full
    traceback on every reconnect attempt (twice a second while a server is down). A connection's first
    error line is logged at debug level if another connection of the same logger warned of it within a
    minute (a client made again and again while NATS is down)."""
    last = ""

    async def on_error(e: Exception) -> None:
        nonlocal last
        line = f"{type(e).__name__}: {e}"
        if line == last:
            return
        first, last = not last, line
        now = time.monotonic()
        if first and now - _WARNED.get((log.name, line), -_REPEAT_S) < _REPEAT_S:
            log.debug("nats: %s", line)
            return
        if len(_WARNED) > 256:  # (lines that name ports and addresses: kept few)
            _WARNED.clear()
        _WARNED[(log.name, line)] = now
        log.warning("nats: %s", line)

    return on_error


def _auth_refused(e: Exception) -> bool:
    return "authorization violation" in str(e).lower() or "authentication" in str(e).lower()


PING_INTERVAL_S = 1.0
MAX_OUTSTANDING_PINGS = 2
"""A server that answers no ping for about PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1) seconds is
given up for another of the cluster's: a cut network sends no FIN, and nats-py's default (pings every
2 minutes) would leave a client deaf to membership for minutes, and a worker unheard, well past the
member TTL (10 s by default: a worker cut off from its node must be heard through another within it)."""
CONNECT_ATTEMPT_S = 2.0
"""How long one attempt to reach one server may take (the Go client's default), so that a failover
that tries the lost server again, or a first connection to a list with an unreachable server in it,
moves on to the next in seconds."""


def _tls_only_client() -> type:
    """nats-py's client class, but one given a TLS context talks TLS or not at all. nats-py upgrades a
    connection only when the server's first INFO asks for it (`tls_required`): a server in the middle
    that leaves that out would get our CONNECT in clear text (a password; an nkey's signature over the
    nonce it passed on from the real server)."""
    import nats.aio.client

    class TlsOnly(nats.aio.client.Client):
        async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
            if initial_connection:
                info["tls_required"] = True  # the dict the TLS decision reads next (`_server_info`)
            await super()._process_info(info, initial_connection)
    return TlsOnly


async def nats_connect(url: str, timeout_s: float, log: logging.Logger, *, role: Role = "client",
                       creds: NatsCreds | None = None, tls: ssl.SSLContext | None = None, **callbacks: Any) -> Any:
    """A nats-py connection to `url` (one server, or a comma-separated list of a cluster's) that, once
    up, reconnects forever (a restarted server, or another of the cluster's, is picked up again), with
    its errors logged by `nats_error_logger`; the first connection must succeed within `timeout_s`
    seconds. It authenticates as `creds`, else with the user and password in `url`, else as the
    credentials `find_creds(role)` finds (KVPOOL_NATS_CREDS, or `kvpool up`'s in the state folder).
    A server that refuses them, or whose TLS certificate we do not trust, raises AuthError at once.
    `tls`: talk TLS, verified by this context (e.g. `ssl.create_default_context(cafile=...)`; default:
    one trusting the CA file named by `KVPOOL_NATS_TLS_CA`, if set). Publishes the server denies
    (see `nats_creds.PERMISSIONS`) are logged and kept for `nats_denied`. `callbacks`: nats-py's,
    e.g. `disconnected_cb`, `reconnected_cb`."""
    import nats.aio.client

    servers = [u.strip() for u in url.split(",") if u.strip()]  # a NATS cluster: any of its servers
    # spread over the cluster's servers, but in a fixed order from here on: nats-py then tries the server
    # it lost last (its own shuffle on each reconnect may try the lost one first)
    random.shuffle(servers)
    if creds is None and not any("@" in u for u in servers):
        creds = find_creds(role)
    auth: dict[str, Any] = dict(creds.connect_options()) if creds is not None else {}
    if tls is None and os.environ.get("KVPOOL_NATS_TLS_CA"):
        tls = ssl.create_default_context(cafile=os.environ["KVPOOL_NATS_TLS_CA"])
    if tls is not None:
        auth["tls"] = tls
    logger = nats_error_logger(log)
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    denied: list[str] = []

    async def on_error(e: Exception) -> None:
        if (_auth_refused(e) or isinstance(e, ssl.SSLCertVerificationError)) and not refused.done():
            refused.set_result(e)
        if "permissions violation" in str(e).lower():
            denied.append(str(e))
            del denied[:-16]
        await logger(e)

    nc: Any = _tls_only_client()() if tls is not None else nats.aio.client.Client()
    connecting: asyncio.Future[Any] = asyncio.ensure_future(nc.connect(
        servers, connect_timeout=min(timeout_s, CONNECT_ATTEMPT_S), dont_randomize=True, allow_reconnect=True,
        max_reconnect_attempts=-1, reconnect_time_wait=0.5, ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS, error_cb=on_error, **auth, **callbacks))
    racing: set[asyncio.Future[Any]] = {connecting, refused}
    done, _ = await asyncio.wait(racing, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if connecting not in done:
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        await _close_quietly(nc, log)
        if refused in done and isinstance(refused.result(), ssl.SSLCertVerificationError):
            raise AuthError(f"NATS at {redacted_url(url)}: its TLS certificate is not trusted (KVPOOL_NATS_TLS_CA "
                            f"names the CA file to trust): {refused.result()}")
        if refused in done:
            who = f"as {creds.user!r} (from {creds.path or 'the caller'})" if creds is not None else (
                "with the credentials in the URL" if "@" in url else
                f"without credentials (none in {creds_path(role)} or KVPOOL_NATS_CREDS)")
            raise AuthError(f"NATS at {redacted_url(url)} refused to let us in {who}: {refused.result()}")
        raise asyncio.TimeoutError(f"no NATS server answered at {redacted_url(url)} within {timeout_s} s")
    refused.cancel()
    if connecting.exception() is not None:
        await _close_quietly(nc, log)
        connecting.result()  # raises what the connection failed with
    nc.kvpool_denied = denied  # for nats_denied
    return nc


async def _close_quietly(nc: Any, log: logging.Logger) -> None:
    """Close a connection that never came up (its socket with it)."""
    try:
        await nc.close()
    except Exception as e:  # nothing left to release but the socket, which close() has dropped
        log.debug("closing a refused NATS connection: %r", e)
    transport = getattr(nc, "_transport", None)
    if transport is not None:
        transport.close()


def nats_denied(nc: Any, subject_prefix: str = "") -> str | None:
    """The latest publish the server refused on connection `nc` (from `nats_connect`) whose subject
    starts with `subject_prefix` (case-insensitive), as the server said it; None if none. nats-server
    drops a denied publish with only an asynchronous error, so a request to it times out: check here
    to report a timeout as the AuthError it is."""
    needle = f'publish to "{subject_prefix.lower()}'
    return next((d for d in reversed(getattr(nc, "kvpool_denied", [])) if needle in d.lower()), None)


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
    if isinstance(err, (nats.errors.AuthorizationError, nats.errors.InvalidUserCredentialsError)) or (
            type(err) is nats.errors.Error and _auth_refused(err)):
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
