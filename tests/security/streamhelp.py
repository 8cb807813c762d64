"""The forger of the stream security tests: it publishes straight to NATS, as anyone allowed on a
stream's subjects could."""
from __future__ import annotations

import asyncio
import logging

from kvpool.core import nats_connect

log = logging.getLogger("test.forger")


def forge(url: str, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
    """Publish (subject, body, headers) straight to NATS, as anyone allowed on the subjects could."""
    async def run() -> None:
        nc = await nats_connect(url, 5, log)
        try:
            for subj, body, headers in messages:
                await nc.publish(subj, body, headers=headers or None)
            await nc.flush()
        finally:
            await nc.close()
    asyncio.run(run())
