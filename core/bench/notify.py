"""kvtest's notifications across instances, as the cache suite sees them: the writer announces each
batch of blocks it created, readers take the announced keys first. They travel on a kvpool stream,
so the implementation is the streams face's (`IMPLEMENTATION`), loaded by module path (`registry`)
when a multi-node run starts: core imports no face.
"""
from __future__ import annotations

import os
from typing import Any, Protocol

from ..errors import BenchError, KVPoolError
from ..nats_creds import creds_dir
from ..registry import load

__all__ = ["IMPLEMENTATION", "Notifier", "NotifyReader", "open_notifier", "open_notify_reader", "announce",
           "AnnouncedSince"]

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

    received: int
    """Announcements of the followed run received so far."""

    def take(self, n: int) -> list[str]:
        """Up to `n` announced keys not yet taken."""
        ...

    def metrics(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def open_notifier(nats_url: str, namespace: str) -> Notifier:
    """The writer's side of `namespace`'s notifications, on the cluster at `nats_url` (a failure to set
    them up a BenchError that says what failed, as `announce`'s)."""
    try:
        made: Notifier = load(f"{IMPLEMENTATION}:Notifier")(nats_url, namespace)
    except KVPoolError as e:
        raise BenchError(f"the writer's notifications could not be set up: {type(e).__name__}: {e}{_creds_hint()}") \
            from e
    return made


def open_notify_reader(nats_url: str, namespace: str) -> NotifyReader:
    """A reader of `namespace`'s notifications from now on."""
    made: NotifyReader = load(f"{IMPLEMENTATION}:NotifyReader")(nats_url, namespace)
    return made


def announce(notifier: Notifier, run: str, keys: list[str]) -> None:
    """`notifier.announce(run, keys)`; its failure a BenchError that says what failed (and, with
    KVPOOL_NATS_CREDS set, that its one NATS user serves every role of the run)."""
    try:
        notifier.announce(run, keys)
    except KVPoolError as e:
        raise BenchError(f"the writer's announcement of {len(keys)} created blocks failed: "
                         f"{type(e).__name__}: {e}{_creds_hint()}") from e


def _creds_hint() -> str:
    """With KVPOOL_NATS_CREDS set, that its one NATS user serves every role of the run."""
    creds = os.environ.get("KVPOOL_NATS_CREDS")
    return (f" (KVPOOL_NATS_CREDS={creds} is the NATS user of every connection of this run: where it may not "
            "publish to streams, name one that may, the client role's or the admin's, or unset it to use each "
            f"role's own file in {creds_dir()})") if creds else ""


class AnnouncedSince:
    """How many batches the writer announced while a reader listened, from the writer's key windows
    (`announced`: its announcements so far; `seq`: its publishes of the window). Counted from the first
    window of a run published after the reader began to follow that run: the one it read then may count
    announcements made before it listened, which it never receives."""

    def __init__(self) -> None:
        self.run: str | None = None
        self.seq = -1
        self.base: int | None = None

    def saw(self, window: dict[str, Any]) -> None:
        """A window the reader read (and follows the run of, from now on)."""
        if window["run"] != self.run:
            self.run, self.seq, self.base = window["run"], int(window.get("seq", -1)), None
        elif self.base is None and int(window.get("seq", -1)) > self.seq and "announced" in window:
            self.base = int(window["announced"])

    def since(self, window: dict[str, Any]) -> int:
        """Announcements of the followed run since counting began, as `window` (a later one) says; 0
        where it cannot tell (another run, a writer that does not announce or say so)."""
        if window["run"] != self.run or self.base is None or "announced" not in window:
            return 0
        return int(window["announced"]) - self.base
