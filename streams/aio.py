"""AsyncConsumer: the asyncio form of `Consumer`, on the caller's event loop, as an async iterator or
with a callback.

    async with AsyncConsumer("events", url) as c:
        async for msg in c:
            ...
            await msg.ack()

    async with AsyncConsumer("events", url) as c:
        handle = await c.consume(on_message)   # acked when it returns, redelivered when it raises
        ...
        await handle.stop()

Same semantics as `Consumer` (groups, start, acks, bounds, max_deliver and the dead-letter subject,
'invalid' messages, limits, the stream secret); by-reference payloads are fetched from the pool in a
worker thread so the loop never blocks on bulk reads.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors

from kvpool.core import PoolClient

from . import envelope as env
from ._link import connect, translate
from .admin import check_token, subject
from .consumer import MAX_DELIVER, POLL_S, Checks, Start, bury, consumer_config, decode, pull_one
from .errors import PayloadError, StreamError, StreamUnavailable
from .message import BaseMessage

log = logging.getLogger("kvpool.streams")

_RETRY_S = 0.5
"""Pause before `consume` asks again after NATS was unreachable (the connection reconnects by itself)."""


class AsyncMessage(BaseMessage):
    """A delivery from `AsyncConsumer`: `Message`'s fields, with ack/nak/term as coroutines (they run on
    the consumer's loop)."""

    _raw: Any = None
    _settled = False

    async def ack(self) -> None:
        """Done with it: never deliver it to this consumer (or group) again."""
        await self._op("ack")

    async def nak(self, delay_s: float = 0.0) -> None:
        """Not processed: deliver it again after `delay_s` seconds."""
        await self._op("nak", delay_s)

    async def term(self) -> None:
        """Never deliver it again, unprocessed (e.g. its payload is missing from the pool)."""
        await self._op("term")

    async def _op(self, op: str, delay_s: float = 0.0) -> None:
        self._settled = True
        try:
            await (self._raw.nak(delay=delay_s or None) if op == "nak" else getattr(self._raw, op)())
        except Exception as e:
            raise translate(e, f"{op} message {self.seq}") from e


Callback = Callable[[AsyncMessage], Awaitable[None] | None]
"""What `AsyncConsumer.consume` calls per message: a coroutine function or a plain function."""


class Consuming:
    """A running `AsyncConsumer.consume`. `await stop()` ends it; a message whose callback is still
    running then is not acked, so it is redelivered (at least once)."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def stop(self) -> None:
        """End the loop; raises the error that ended it first, if one did (e.g. StreamNotFound)."""
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class AsyncConsumer:
    """Receives from stream `stream` on the running event loop; see `Consumer` for the options."""

    def __init__(self, stream: str, nats_url: str, *, group: str | None = None, start: Start = "all",
                 pool: PoolClient | None = None, topic: str = ">", ack_wait_s: float = 30.0,
                 max_ack_pending: int = 1000, fetch: bool = True, timeout_s: float = 5.0,
                 max_deliver: int = MAX_DELIVER, limits: env.Limits | None = None,
                 secret: str | bytes | None = None) -> None:
        self.stream, self.group, self.pool, self.fetch = check_token(stream, "stream name"), group, pool, fetch
        if group is not None:
            check_token(group, "group")
        self._cfg = consumer_config(start, ack_wait_s, max_ack_pending)
        self._checks = Checks(stream, pool, limits, max_deliver, secret)
        self._filter = subject(stream, ">" if topic == ">" else check_token(topic, "topic"))
        self._url, self._timeout_s = nats_url, timeout_s
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None
        self._consuming: set[asyncio.Task[None]] = set()  # `consume` loops running: `close` ends them

    async def open(self) -> AsyncConsumer:
        """Connect and create (or join) the JetStream consumer."""
        self._nc = await connect(self._url, self._timeout_s)
        if self.group is None:
            self._cfg.inactive_threshold = 60.0
        try:
            self._js = self._nc.jetstream(timeout=self._timeout_s)
            self._sub = await self._js.pull_subscribe(
                self._filter, durable=self.group, stream=self.stream, config=self._cfg)
        except Exception as e:
            await self._nc.close()
            raise translate(e, f"subscribe to stream {self.stream!r}") from e
        return self

    @property
    def counts(self) -> dict[str, int]:
        """Messages seen invalid, forged (bad or missing signature) and dead-lettered, so far."""
        return dict(self._checks.counts)

    async def receive(self, timeout: float = 1.0, into: Any = None) -> AsyncMessage | None:
        """The next message, or None if none arrives within `timeout` seconds (see Consumer.receive)."""
        timeout = max(timeout, POLL_S)
        deadline = time.monotonic() + timeout
        wait = timeout
        while True:
            try:
                raw = await pull_one(self._js, self._sub, self.stream, self.group or self._sub._consumer, wait)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return None
            except Exception as e:
                raise translate(e, f"receive from stream {self.stream!r}") from e
            reason = self._checks.exhausted(raw)
            if reason is None:
                break
            await self._bury(raw, reason)
            wait = deadline - time.monotonic()
            if wait <= 0:
                return None
        msg = AsyncMessage(0, "", "", b"", {}, 0, 0.0)
        msg._raw = raw
        if (raw.headers or {}).get(env.KIND) in (env.REF, env.KV, env.KV_LAYERS) and self.fetch:
            return await asyncio.to_thread(decode, raw, self._checks, into, self.fetch, msg)
        return decode(raw, self._checks, into, self.fetch, msg)

    async def _bury(self, raw: Any, reason: str) -> None:
        name = self.group or self._sub._consumer
        try:
            await bury(self._nc, self.stream, name, raw, reason)
        except Exception as e:
            raise translate(e, f"dead-letter message {raw.metadata.sequence.stream} of {self.stream!r}") from e
        self._checks.buried(raw, name, reason)

    async def consume(self, callback: Callback, *, nak_delay_s: float = 1.0) -> Consuming:
        """Call `callback(msg)` for each message, in stream order, from a task on the running loop.

        A message the callback leaves unsettled is acked when it returns. If the callback raises, the
        error is logged and the message is nak'ed (redelivered after `nak_delay_s` seconds): one bad
        message never stops the loop. A message that cannot be decoded ('invalid') or whose payload
        cannot be delivered intact (PayloadError) never reaches the callback: it is logged, sent to the
        dead-letter subject and terminated. While NATS is unreachable the loop waits for it to come
        back; a deleted stream (or consumer) ends it with StreamNotFound, and `close` ends it too.
        Returns the handle that stops it."""
        task = asyncio.get_running_loop().create_task(self._consume(callback, nak_delay_s))
        self._consuming.add(task)
        task.add_done_callback(self._consuming.discard)
        return Consuming(task)

    async def _consume(self, callback: Callback, nak_delay_s: float) -> None:
        while True:
            try:
                msg = await self.receive(1.0)
            except PayloadError as e:
                log.error("stream %r: %s; dead-lettering it", self.stream, e)
                if isinstance(e.message, AsyncMessage):
                    await self._dead_letter(e.message, str(e))
                continue
            except StreamUnavailable as e:
                if self._nc is None or self._nc.is_closed:  # closed by `close` (from the callback, say)
                    return
                log.warning("stream %r: %s; retrying", self.stream, e)
                await asyncio.sleep(_RETRY_S)
                continue
            if msg is not None and msg.error is not None:
                await self._dead_letter(msg, str(msg.error))
            elif msg is not None:
                await self._handle(callback, msg, nak_delay_s)

    async def _dead_letter(self, msg: AsyncMessage, reason: str) -> None:
        msg._settled = True
        try:
            await self._bury(msg._raw, reason)
        except StreamError as e:  # NATS away: unsettled, the message comes back after the ack wait
            log.warning("stream %r: %s", self.stream, e)

    async def _handle(self, callback: Callback, msg: AsyncMessage, nak_delay_s: float) -> None:
        try:
            result = callback(msg)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("stream %r: callback failed on message %d; it will be redelivered", self.stream, msg.seq)
            await self._settle(msg, "nak", nak_delay_s)
            return
        await self._settle(msg, "ack", 0.0)

    async def _settle(self, msg: AsyncMessage, op: str, delay_s: float) -> None:
        if msg._settled:
            return
        try:
            await msg._op(op, delay_s)
        except StreamError as e:  # NATS away: unsettled, the message comes back after the ack wait
            log.warning("stream %r: %s", self.stream, e)

    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> AsyncMessage:
        while True:
            msg = await self.receive(1.0)
            if msg is not None:
                return msg

    async def close(self) -> None:
        """End the `consume` loops and disconnect; a private consumer is deleted, a group's durable
        consumer stays."""
        await self._stop_consuming()
        if self._nc is None:
            return
        try:
            if self.group is None and self._sub is not None:
                await self._nc.jetstream().delete_consumer(self.stream, self._sub._consumer)
        except (ConnectionError, nats.errors.Error):
            pass  # the server already dropped it, or is gone: nothing to release
        await self._nc.close()
        self._nc = None

    async def _stop_consuming(self) -> None:
        """Cancel the `consume` loops and wait for them to end (but the one calling this, if one is: it
        ends at its next receive, which finds the connection closed)."""
        loops = [t for t in self._consuming if t is not asyncio.current_task()]
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)

    async def __aenter__(self) -> AsyncConsumer:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
