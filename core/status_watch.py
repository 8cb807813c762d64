"""`kvpool status --watch`: live rates per worker in the terminal, redrawn every interval.

Rates are differences of each worker's cache counters between two polls (`PoolClient.stats()`),
divided by the seconds between them: lookups (gets), puts, the hit rate over the interval, evictions
and tier moves per second, next to DRAM fill and SSD bytes. A worker that restarted (counters went
back) shows no rates for one interval; one that joined shows them from its second poll.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import TYPE_CHECKING, TextIO

from .records import PoolStats
from .stats import CacheStats

__all__ = ["Row", "rates", "render", "watch"]

if TYPE_CHECKING:
    from .client import PoolClient

_HITS = ("hits_dram", "hits_ssd", "hits_device")
_CLEAR = "\x1b[H\x1b[2J"


@dataclasses.dataclass
class Row:
    worker: str
    node: str
    address: str
    gets_s: float | None
    puts_s: float | None
    hit_rate: float | None
    """hits / lookups over the interval; None without lookups or rates"""
    evict_s: float | None
    demote_s: float | None
    promote_s: float | None
    dram_bytes: int
    dram_capacity: int
    ssd_bytes: int


def _lookups(c: CacheStats) -> int:
    return c.hits_dram + c.hits_ssd + c.hits_device + c.misses


def _deltas(c: CacheStats, p: CacheStats) -> dict[str, float] | None:
    """Counter increases between two polls of one worker; None if any went back (it restarted)."""
    d = {k: float(getattr(c, k) - getattr(p, k)) for k in ("puts", "evictions", "demotions", "promotions")}
    d["lookups"] = float(_lookups(c) - _lookups(p))
    d["hits"] = float(sum(getattr(c, k) - getattr(p, k) for k in _HITS))
    return None if any(v < 0 for v in d.values()) else d


def rates(prev: PoolStats, cur: PoolStats, seconds: float) -> list[Row]:
    """One row per worker in `cur` (both are `PoolClient.stats()` of a cluster), sorted by worker id."""
    rows = []
    for w, s in sorted(cur.workers.items()):
        c = s.cache if s.cache is not None else CacheStats()
        before = prev.workers.get(w)
        p = before.cache if before is not None else None
        d = _deltas(c, p) if p is not None and s.cache is not None and seconds > 0 else None
        r: dict[str, float | None] = {k: (d[k] / seconds if d is not None else None)
                                      for k in ("lookups", "puts", "evictions", "demotions", "promotions")}
        i = s.info
        fill = i if s.cache is None else c  # a worker that did not answer: its last heartbeat's figures
        rows.append(Row(w, i.node_id or "?", i.tcp or "?", r["lookups"], r["puts"],
                        (d["hits"] / d["lookups"]) if d is not None and d["lookups"] > 0 else None,
                        r["evictions"], r["demotions"], r["promotions"],
                        fill.dram_bytes, fill.dram_capacity, fill.ssd_bytes))
    return rows


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def render(rows: list[Row], where: str, interval: float) -> str:
    """The table, with a totals line when there are several workers."""
    ww = max([12, *(len(r.worker) for r in rows)])  # as wide as the longest entry (a node id may be long)
    wn = max([14, *(len(r.node) for r in rows)])
    wa = max([21, *(len(r.address) for r in rows)])
    head = (f"{'worker':<{ww}} {'node':<{wn}} {'address':<{wa}} {'gets/s':>10} {'puts/s':>9} {'hit':>6} "
            f"{'evict/s':>8} {'demote/s':>8} {'promote/s':>9} {'dram':>17} {'ssd MiB':>9}")
    lines = [f"kvpool status {where}  every {interval:g} s  {time.strftime('%H:%M:%S')}", head]
    for r in rows:
        fill = f"{r.dram_bytes >> 20}/{r.dram_capacity >> 20} MiB"
        hit = "-" if r.hit_rate is None else f"{r.hit_rate:.0%}"
        lines.append(f"{r.worker:<{ww}} {r.node:<{wn}} {r.address:<{wa}} {_num(r.gets_s):>10} {_num(r.puts_s):>9} "
                     f"{hit:>6} "
                     f"{_num(r.evict_s):>8} {_num(r.demote_s):>8} {_num(r.promote_s):>9} {fill:>17} "
                     f"{r.ssd_bytes >> 20:>9}")
    if len(rows) > 1:
        def total(field: str) -> float | None:  # None (shown "-") while no worker has rates yet
            values = [getattr(r, field) for r in rows if getattr(r, field) is not None]
            return sum(values) if values else None
        fill = f"{sum(r.dram_bytes for r in rows) >> 20}/{sum(r.dram_capacity for r in rows) >> 20} MiB"
        lines.append(f"{'all':<{ww}} {'':<{wn}} {'':<{wa}} {_num(total('gets_s')):>10} {_num(total('puts_s')):>9} "
                     f"{'':>6} {_num(total('evict_s')):>8} {_num(total('demote_s')):>8} {_num(total('promote_s')):>9} "
                     f"{fill:>17} {sum(r.ssd_bytes for r in rows) >> 20:>9}")
    if not rows:
        lines.append("(no live workers)")
    return "\n".join(lines)


def watch(client: PoolClient, where: str, interval: float = 2.0, count: int = 0, out: TextIO = sys.stdout) -> int:
    """Poll `client.stats()` every `interval` seconds and redraw; `count` > 0 stops after that many
    tables (the first has no rates yet). Ctrl-C ends it."""
    prev, t_prev = client.stats(), time.monotonic()
    rows = rates(PoolStats(CacheStats()), prev, 0)  # the first table: who is there, no rates yet
    shown = 0
    clear = _CLEAR if out.isatty() else ""
    try:
        while True:
            out.write(clear + render(rows, where, interval) + "\n")
            out.flush()
            shown += 1
            if count and shown >= count:
                return 0
            time.sleep(interval)
            cur, now = client.stats(), time.monotonic()
            rows = rates(prev, cur, now - t_prev)
            prev, t_prev = cur, now
    except KeyboardInterrupt:
        return 0
