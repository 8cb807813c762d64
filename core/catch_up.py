"""A worker back from an absence catches up from its peers before it serves its blocks again.

While a worker is away (stopped, killed, paused, cut off from NATS past the member TTL), clients write
its keys to other workers, so what it holds may be older than what they hold. When it returns it asks
every live peer (back from lapsed heartbeats, also every peer it heard from since a member TTL before
it left: one whose own heartbeats lapse just then is not listed live) for the changes it accepted since
the worker left (`Op.CHANGES`, from each peer's
`versions.ChangeLog`) and drops each block older than one of them (a miss costs a recompute; a stale
hit would cost a wrong answer). If a peer does not answer, or its log does not reach back to when the
worker left, the worker cannot prove any block fresh and drops them all. Until it is done its reads
are misses (`TieredCache.fence`). When it left is known from `AliveStamp`, the wall time of its last
heartbeat (after an absence not caught up before it stopped, of its last one before that), kept beside
its SSD tier (a worker without one starts empty and under a new id). A peer is
asked at the address it registered; another worker answering there now (a restart of a worker without
an SSD tier on the same port) cannot tell what the one asked accepted: as if it did not answer.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from .auth import write_private
from .cache import TieredCache
from .errors import KVPoolError
from .records import WorkerInfo
from .transport import connect
from .versions import CLOCK_SKEW_MS

__all__ = ["AliveStamp", "catch_up"]

log = logging.getLogger("kvpool.worker")



class AliveStamp:
    """Two wall times (unix ms) in a file beside a worker's SSD tier, written atomically at each heartbeat:
    its last sign of life (after a restart: it accepted nothing after it, but for a heartbeat's time) and
    the last time it could vouch for every block it held (its reads neither fenced nor past a deadline:
    a stall or a lapse since is not caught up yet). A restart catches up since the second; the two are
    the same but after such an absence. A worker without an SSD tier keeps none: it starts holding nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> tuple[int, int] | None:
        """(last sign of life, last time current); None when never written (or unreadable)."""
        try:
            stamps = [int(x) for x in self.path.read_text().split()]
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("unreadable alive stamp %s (%s): treated as none", self.path, e)
            return None
        if len(stamps) not in (1, 2):  # (one: written by a version that kept only the first)
            log.warning("unreadable alive stamp %s (%d numbers): treated as none", self.path, len(stamps))
            return None
        return stamps[0], min(stamps)

    def touch(self, current_ms: int | None = None) -> None:
        """Stamp now as the last sign of life; `current_ms` (None: now) as the last time current."""
        now = int(time.time() * 1000)
        try:
            write_private(self.path, f"{now} {now if current_ms is None else min(current_ms, now)}\n")
        except OSError as e:  # a full disk: the next start finds an older stamp (asks for more: safe)
            log.debug("alive stamp %s not written: %s", self.path, e)


def catch_up(cache: TieredCache, peers: Mapping[str, WorkerInfo], since_ms: int, *, token: str | None,
             node_id: str, timeout_s: float = 5.0, partial: bool = False) -> bool:
    """Apply every change each of `peers` accepted since `since_ms` (unix ms) to `cache` (a block older
    than one is dropped). True if every peer answered with a log that reaches back that far; False
    otherwise (the caller then drops what it cannot prove fresh). `partial`: a peer that cannot because it
    is gone, or (re)started since `since_ms` (its log begins with that run), is passed over (logged), the
    others asked all the same; one that has served all along and whose log no longer reaches back is still
    a False."""
    ask_from = max(since_ms - CLOCK_SKEW_MS, 0)  # a peer whose clock runs behind reports all it took
    dropped, whole = 0, True
    for wid, info in peers.items():
        got = _from_peer(cache, wid, info, ask_from, token, node_id, timeout_s, since_ms if partial else None)
        if got is None:
            whole = False
            if not partial:
                return False
        elif got < 0:
            return False
        else:
            dropped += got
    log.info("catch-up from %d peers since %d ms: %d outdated blocks dropped%s", len(peers), since_ms, dropped,
             "" if whole else " (some peers passed over)")
    return whole


def _from_peer(cache: TieredCache, wid: str, info: WorkerInfo, ask_from: int, token: str | None, node_id: str,
               timeout_s: float, pass_over_since: int | None = None) -> int | None:
    """Apply what peer `wid` accepted since `ask_from`: the blocks dropped, or None (logged) if it could not
    tell all of it (unreachable, another worker at its address, a log that does not reach back, a failure).
    With `pass_over_since` (unix ms), a log that does not reach back is -1 unless the peer has been a
    member only since after that time (a restart: None)."""
    same_node = info.node_id == node_id and bool(info.unix) and os.path.exists(info.unix)
    address = info.unix if same_node else info.tcp
    try:
        conn = connect(address, token, timeout_s, spin=False)  # (a worker's: its CPU is its clients')
    except KVPoolError as e:
        log.warning("catch-up: cannot reach peer %s at %s (%s)", wid, address, e)
        return None
    dropped = 0
    try:
        hello = conn.hello()
        answered = hello.worker_id
        if answered != wid:
            log.warning("catch-up: peer %s's address %s is worker %s's now: what %s accepted left with it",
                        wid, address, answered, wid)
            return None
        seq = 0
        while True:
            changes, nxt, covered = conn.changes(ask_from, seq)
            if covered > ask_from:
                log.warning("catch-up: peer %s's log reaches back to %d ms, not to %d ms", wid, covered, ask_from)
                restarted = (hello.member_since or 0) * 1000 > (pass_over_since or 0)
                return None if pass_over_since is None or restarted else -1
            dropped += cache.replicas.apply_changes([(c.key, c.version, c.kind) for c in changes])
            if nxt < 0:
                return dropped
            seq = nxt
    except KVPoolError as e:
        log.warning("catch-up: peer %s at %s failed (%s)", wid, address, e)
        return None
    finally:
        conn.close()
