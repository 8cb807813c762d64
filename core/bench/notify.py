"""kvtest's notifications across instances, as the cache suite sees them: the writer announces each
batch of blocks it created, readers take the announced keys first. They travel on a kvpool stream,
so the implementation is the streams face's (`IMPLEMENTATION`), loaded by module path (`registry`)
when a multi-node run starts: core imports no face.
"""
from __future__ import annotations

from typing import Any, Protocol

from ..registry import load

__all__ = ["IMPLEMENTATION", "Notifier", "NotifyReader", "open_notifier", "open_notify_reader"]

IMPLEMENTATION = "kvpool.streams.kvtest_notify"


class Notifier(Protocol):
    """The writer's side."""

    sent: int
    """Announcements sent so far."""

    def announce(self, run: str, keys: list[str]) -> None: ...

    def close(self) -> None: ...


class NotifyReader(Protocol):
    """The reader's side: announcements of `run` (set by the reader once it knows the writer's run)."""

    run: str | None

    def take(self, n: int) -> list[str]:
        """Up to `n` announced keys not yet taken."""
        ...

    def metrics(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def open_notifier(nats_url: str, namespace: str) -> Notifier:
    """The writer's side of `namespace`'s notifications, on the cluster at `nats_url`."""
    made: Notifier = load(f"{IMPLEMENTATION}:Notifier")(nats_url, namespace)
    return made


def open_notify_reader(nats_url: str, namespace: str) -> NotifyReader:
    """A reader of `namespace`'s notifications from now on."""
    made: NotifyReader = load(f"{IMPLEMENTATION}:NotifyReader")(nats_url, namespace)
    return made
