"""Which workers ranked below a key's owners may hold an older copy of it: those a put or remove tells to
drop it (`ClusterBackend._supersede`).

A worker holds a key's block only if it owned the key when the block was written (or repaired): at some
moment since it began to hold what it holds (`WorkerInfo.held_since`), fewer than `replication` of the
workers ranked above it now were members. A worker ranked above it that has been a member since before
then (`WorkerInfo.member_since`, by more than `MARGIN_S`) was above it at each such moment. So a worker
below the owners is told when fewer than `replication` of the workers above it are that old:

- the first below the owners always (it owned the key if one of them joined; a writer whose member view
  lags may still have written it);
- further down, a worker that owned keys before the ones above it joined: with R=1, a key two joiners
  both rank above its old owner moves two places, and that owner would serve its older copy again once
  both leave.

In a cluster whose workers have been members since before they held anything, that is the first below
the owners alone.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from .records import WorkerInfo
from .versions import CLOCK_SKEW_MS

__all__ = ["MARGIN_S", "told_below"]

MARGIN_S = CLOCK_SKEW_MS / 1000 + 1.0
"""How much earlier than a worker began to hold its blocks another must have become a member to count
as above it all along (3 s): the clock-skew bound between workers (`versions.CLOCK_SKEW_MS`) and a
writer's member view lagging a join (under a second)."""


def told_below(ranking: Sequence[str], replication: int, live: Mapping[str, WorkerInfo]) -> list[str]:
    """The workers of `ranking` (a key's, all live members, highest first) below its first `replication`
    that may hold an older copy of the key: the first below always, then each one fewer than
    `replication` of those above it have been members since before it began to hold its blocks."""
    r = replication
    if len(ranking) <= r:
        return []
    out = [ranking[r]]
    if len(ranking) == r + 1:
        return out
    oldest = sorted(_member_since(live[w]) for w in ranking[:r + 1])[:r]  # the r earliest joins above
    for w in ranking[r + 1:]:
        if bisect.bisect_left(oldest, live[w].held_since - MARGIN_S) < r:
            out.append(w)
        since = _member_since(live[w])
        if since < oldest[-1]:
            bisect.insort(oldest, since)
            oldest.pop()
    return out


def _member_since(info: WorkerInfo) -> float:
    """When `info`'s worker became a member (unknown: it counts as never)."""
    return float("inf") if info.member_since is None else info.member_since
