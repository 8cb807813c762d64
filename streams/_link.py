"""One NATS connection for synchronous callers, and the one place NATS exceptions become stream errors.

nats-py is asyncio-only; `Link` runs it on a private loop thread (`kvpool.core.aio.LoopThread`) so
Producer/Consumer can offer a blocking API. `translate` maps every nats-py exception to a `StreamError`
(`tests/streams/test_stream_errors.py` checks that no nats-py exception class is left out).
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

import nats.js.errors

from kvpool.core import AuthError, LoopThread, NatsCreds, Role, nats_connect, nats_denied, nats_failure, redacted_url

from .errors import StreamError, StreamFull, StreamNotFound, StreamRefused, StreamTimeout, StreamUnavailable

T = TypeVar("T")

# nats-server's descriptions of a publish refused by a full discard=new stream, by the limit hit.
_FULL = {"maximum messages": "max_msgs", "maximum bytes": "max_bytes", "maximum messages per subject":
         "max_msgs_per_subject"}
_NOT_FOUND_CODES = {10059}

log = logging.getLogger("kvpool.streams")


def translate(err: BaseException, what: str) -> BaseException:
    """The stream error for a nats-py exception (or a timeout or socket error) raised while doing
    `what`; other exceptions unchanged. How NATS failed is `kvpool.core.aio.nats_failure`'s call."""
    if isinstance(err, StreamError):
        return err
    # some APIError subclasses (KeyDeletedError, ...) skip APIError.__init__: no description, no err_code
    code, desc = getattr(err, "err_code", None) or 0, getattr(err, "description", None) or ""
    if isinstance(err, nats.js.errors.APIError):
        limit = next((name for text, name in sorted(_FULL.items(), reverse=True) if desc.startswith(text)), None)
        if limit:
            return StreamFull(f"{what}: stream is full ({desc}); it refuses new messages at its {limit} "
                              "limit until consumers ack or retention drops some")
        if code in _NOT_FOUND_CODES or isinstance(err, nats.js.errors.NotFoundError):
            return StreamNotFound(f"{what}: {desc or 'not found'}")
    if isinstance(err, nats.js.errors.NoStreamResponseError):
        return StreamNotFound(f"{what}: no stream takes this subject")
    kind = nats_failure(err)
    if kind is None:
        return err
    if kind == "timeout":
        return StreamTimeout(f"{what}: timed out")
    if kind == "unavailable":
        return StreamUnavailable(f"{what}: NATS unavailable: {err!r}")
    if isinstance(err, nats.js.errors.APIError):
        return StreamRefused(f"{what}: JetStream error {code}: {desc}")
    return StreamRefused(f"{what}: {err!r}")


async def connect(url: str, timeout_s: float, role: Role = "client", creds: NatsCreds | None = None) -> Any:
    """`kvpool.core.aio.nats_connect` as NATS user `role` (or `creds`), its failure a StreamError
    (StreamRefused when the server refuses the credentials)."""
    try:
        return await nats_connect(url, timeout_s, log, role=role, creds=creds)
    except AuthError as e:
        raise StreamRefused(f"connect to {redacted_url(url)}: {e}") from e
    except Exception as e:
        raise translate(e, f"connect to {redacted_url(url)}") from e


class Link:
    """A NATS connection plus JetStream context on a private loop; `call` blocks for a coroutine.
    `role`: the NATS user to connect as (`kvpool.core.nats_creds`): `client` uses streams, `admin`
    creates and deletes them."""

    def __init__(self, url: str, timeout_s: float = 5.0, *, role: Role = "client",
                 creds: NatsCreds | None = None) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.io = LoopThread("kvpool-streams")
        try:
            self.nc = self.call(connect(url, timeout_s, role, creds), f"connect to {redacted_url(url)}")
        except BaseException:
            self.io.stop()
            raise
        self.js = self.nc.jetstream(timeout=timeout_s)
        # a link dropped unclosed (its owner collected) disconnects too: its loop thread would otherwise
        # keep the connection, reconnecting for ever, for the life of the process
        self._closer = weakref.finalize(self, self.io.shut, self.nc.close)
        self._closer.atexit = False  # (a process that exits takes its connections along)

    def call(self, coro: Coroutine[Any, Any, T], what: str, timeout: float | None = None) -> T:
        """Run `coro` on the loop; NATS errors come back as stream errors (StreamUnavailable after close)."""
        if self.io.loop.is_closed():
            coro.close()
            raise StreamUnavailable(f"{what}: the connection to {redacted_url(self.url)} is closed")
        before = nats_denied(self.nc) if hasattr(self, "nc") else None
        try:
            return self.io.run(coro, (timeout if timeout is not None else self.timeout_s) + 2)
        except Exception as e:
            err = translate(e, what)
            denied = nats_denied(self.nc) if isinstance(err, StreamTimeout) and hasattr(self, "nc") else None
            if denied and denied is not before:  # nats-server drops a denied publish: it shows as a timeout
                raise StreamRefused(f"{what}: this NATS user may not do it: {denied}") from e
            raise err from e

    def close(self) -> None:
        """Disconnect and stop the loop thread; again, nothing."""
        self._closer()
