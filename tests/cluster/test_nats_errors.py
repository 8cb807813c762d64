"""nats-py's asynchronous errors reach the log as one line per change, not a traceback per retry."""
from __future__ import annotations

import asyncio
import logging

import pytest

from kvpool.core.aio import nats_error_logger


def test_repeated_errors_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    on_error = nats_error_logger(logging.getLogger("kvpool.test"))

    async def outage() -> None:
        for _ in range(5):  # a server down: the same refusal at every reconnect attempt
            await on_error(ConnectionRefusedError(111, "Connect call failed"))
        await on_error(TimeoutError("nats: timeout"))
        await on_error(ConnectionRefusedError(111, "Connect call failed"))

    with caplog.at_level(logging.WARNING, logger="kvpool.test"):
        asyncio.run(outage())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["nats: ConnectionRefusedError: [Errno 111] Connect call failed",
                     "nats: TimeoutError: nats: timeout",
                     "nats: ConnectionRefusedError: [Errno 111] Connect call failed"]
    assert all(r.exc_info is None for r in caplog.records)


def test_a_client_made_again_and_again_warns_of_the_same_error_once(caplog: pytest.LogCaptureFixture) -> None:
    """A connection's first error, warned of within a minute by another connection of the same logger
    (an engine's adapter making its client again while NATS is down), goes to debug; a new error does not."""
    log = logging.getLogger("kvpool.test.again")

    async def attempts() -> None:
        for _ in range(3):
            await nats_error_logger(log)(ConnectionRefusedError(111, "Connect call failed"))
        await nats_error_logger(log)(TimeoutError("nats: timeout"))

    with caplog.at_level(logging.WARNING, logger="kvpool.test.again"):
        asyncio.run(attempts())
    assert [r.getMessage() for r in caplog.records] == ["nats: ConnectionRefusedError: [Errno 111] Connect call failed",
                                                       "nats: TimeoutError: nats: timeout"]
