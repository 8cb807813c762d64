"""kvtest's CSV result rows, so the scripts and spreadsheets kvtest users keep read kvpool's runs.

One row per operation of a run: `timestamp,op,count,success,fail,qps,avg_ms,p50_ms,p90_ms,p99_ms,
p99_9_ms,min_ms,max_ms,bytes` — timestamp the run's end (ISO 8601, UTC), count the calls (a call
moves `batch_keys_count` keys), fail the calls that raised or returned wrong bytes, qps calls per
second of the run, latencies of the calls in milliseconds, bytes the block bytes the op moved.
"""
from __future__ import annotations

import csv
import datetime
import os
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError

__all__ = ["HEADER", "row", "write"]

HEADER = ("timestamp", "op", "count", "success", "fail", "qps", "avg_ms", "p50_ms", "p90_ms", "p99_ms",
          "p99_9_ms", "min_ms", "max_ms", "bytes")


def row(op: str, latencies_s: Sequence[float], fail: int, seconds: float, nbytes: int,
        when: datetime.datetime | None = None) -> dict[str, object]:
    """The row of `op` from its calls' latencies (seconds) over a run of `seconds`."""
    ms = np.asarray(latencies_s, dtype=np.float64) * 1e3
    count = int(ms.size)
    stamp = (when or datetime.datetime.now(datetime.timezone.utc)).isoformat(timespec="seconds")

    def q(pct: float) -> float:
        return round(float(np.percentile(ms, pct)), 3) if count else 0.0
    return {"timestamp": stamp, "op": op, "count": count, "success": count - fail, "fail": fail,
            "qps": round(count / seconds, 1) if seconds > 0 else 0.0,
            "avg_ms": round(float(ms.mean()), 3) if count else 0.0, "p50_ms": q(50), "p90_ms": q(90),
            "p99_ms": q(99), "p99_9_ms": q(99.9), "min_ms": round(float(ms.min()), 3) if count else 0.0,
            "max_ms": round(float(ms.max()), 3) if count else 0.0, "bytes": int(nbytes)}


def check_writable(path: str | os.PathLike[str]) -> None:
    """ConfigError, before a run, if rows could not be appended to `path` (no such folder, no right to
    write): a run's figures are not to be lost to its CSV at the end."""
    try:
        with open(path, "a", newline=""):
            pass
    except OSError as e:
        raise _unwritable(path, e) from e


def write(path: str | os.PathLike[str], rows: Sequence[dict[str, object]]) -> None:
    """Append `rows` to the CSV file at `path`, with the header if the file is new or empty; a
    failure to (a folder gone since `check_writable`) is a ConfigError naming the file."""
    try:
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=HEADER)
            if new:
                w.writeheader()
            w.writerows(rows)
    except OSError as e:
        raise _unwritable(path, e) from e


def _unwritable(path: str | os.PathLike[str], e: OSError) -> ConfigError:
    return ConfigError(f"--csv {os.fspath(path)!r}: cannot write it ({e.strerror or e})")
