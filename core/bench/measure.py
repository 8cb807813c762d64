"""Shared machinery of the benchmark suites: timing, progress, percentiles and the summary/JSON output.

Every suite ends with `emit()`, so the summary table, the `--report DIR` files and the `--json` line
(always the last line printed) look the same whichever suite produced them.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import report

__all__ = ["LATENCY_QS", "best_seconds", "best_in_turns", "gbps", "percentiles_us", "filled", "Progress", "emit"]

log = logging.getLogger("kvpool.bench")

LATENCY_QS = (50, 90, 99, 99.9)
"""Percentiles of every latency `emit()` is given (metric names p50, p90, p99, p999)."""


def best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of `repeat` timed calls of `fn` (after the caller's warm-up)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def best_in_turns(turns: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    """The fewest seconds of each of `turns` (each call times one turn and returns its seconds) over
    `repeat` rounds after one warm-up round. They take turns round by round, so load from elsewhere on
    a shared machine falls on all of them alike."""
    best = dict.fromkeys(turns, float("inf"))
    for r in range(repeat + 1):
        for name, turn in turns.items():
            elapsed = turn()
            if r:
                best[name] = min(best[name], elapsed)
    return best


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def percentiles_us(samples_s: Sequence[float] | np.ndarray, qs: tuple[float, ...] = LATENCY_QS) -> dict[str, float]:
    """{"p50": microseconds, ...} of latency samples given in seconds (NaN when there are none)."""
    arr = np.asarray(samples_s, dtype=np.float64) * 1e6
    if arr.size == 0:
        return {f"p{q:g}".replace(".", ""): float("nan") for q in qs}
    return {f"p{q:g}".replace(".", ""): round(float(np.percentile(arr, q)), 1) for q in qs}


def filled(nbytes: int, seed: int) -> np.ndarray:
    """A pre-faulted buffer of `nbytes` random bytes (first touch is slow here: never time it)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Progress:
    """A one-line progress bar on a terminal; a log line every `every_s` otherwise (CI logs, pipes)."""

    def __init__(self, total: float, label: str, every_s: float = 5.0) -> None:
        self.total, self.label, self.every_s = total, label, every_s
        self._tty = sys.stderr.isatty()
        self._last = time.monotonic()  # the first line after one interval: a start line says nothing

    def update(self, done: float, extra: str = "") -> None:
        now = time.monotonic()
        if now - self._last < (0.2 if self._tty else self.every_s):
            return
        self._last = now
        frac = min(done / self.total, 1.0) if self.total else 1.0
        if self._tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {extra}")
            sys.stderr.flush()
        else:
            log.info("%s %.0f%% %s", self.label, frac * 100, extra)

    def close(self) -> None:
        if self._tty:
            sys.stderr.write("\n")


def emit(suite: str, metrics: dict[str, Any], ratios: dict[str, float], as_json: bool, notes: str = "", *,
         latencies: Mapping[str, Sequence[float] | np.ndarray] | None = None,
         timeline: list[dict[str, float]] | None = None) -> None:
    """Print the summary, write the `--report` files if the runner asked for them, and (with --json)
    print the one-line JSON object last.

    `latencies` (seconds per op name) become `{op}_p50_us` ... `{op}_p999_us` metrics, a table and the
    report's latency CDF; `timeline` rows (`t_s` plus any of `gbps`, `hit_rate`, `*_bytes`) feed the
    report's plots over time.
    """
    arrays = {op: np.asarray(s, dtype=np.float64) for op, s in (latencies or {}).items()}
    lat = {op: a for op, a in arrays.items() if a.size}  # an op that never ran has no percentiles
    lat_metrics = {f"{op}_{k}_us": v for op, s in lat.items() for k, v in percentiles_us(s).items()}
    metrics = {**metrics, **lat_metrics}
    print(f"kvpool bench {suite}" + (f" ({notes})" if notes else ""))
    width = max((len(k) for k in [*metrics, *ratios, "latency (us)"]), default=10)
    for k, v in metrics.items():
        if k not in lat_metrics:
            print(f"  {k:<{width}}  {v}")
    if lat:
        names = [f"p{q:g}".replace(".", "") for q in LATENCY_QS]
        print(f"  {'latency (us)':<{width}}  {'n':>8}" + "".join(f"{n:>10}" for n in names))
        for op, s in lat.items():
            print(f"  {op:<{width}}  {s.size:>8}" + "".join(f"{metrics[f'{op}_{n}_us']:>10}" for n in names))
    for k, v in ratios.items():
        print(f"  {k:<{width}}  {report.ratio_text(v)}")
    rounded = {k: round(v, 3) for k, v in ratios.items()}
    report.write_if_requested({
        "suite": suite, "notes": notes, "metrics": metrics, "ratios": rounded,
        "latency_cdf_us": {op: (np.percentile(s, np.arange(101)) * 1e6).round(1).tolist() for op, s in lat.items()},
        "timeline": timeline or []})
    if as_json:
        print(json.dumps({"suite": suite, "metrics": metrics, "ratios": rounded}))
