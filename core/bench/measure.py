"""Shared machinery of the benchmark suites: timing, progress, and the report/JSON output."""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("kvpool.bench")


def best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of `repeat` timed calls of `fn` (after the caller's warm-up)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def percentiles_us(samples_s: list[float] | np.ndarray, qs: tuple[float, ...] = (50, 99)) -> dict[str, float]:
    arr = np.asarray(samples_s, dtype=np.float64) * 1e6
    if arr.size == 0:
        return {f"p{q:g}": float("nan") for q in qs}
    return {f"p{q:g}".replace(".", ""): round(float(np.percentile(arr, q)), 1) for q in qs}


def filled(nbytes: int, seed: int) -> np.ndarray:
    """A pre-faulted buffer of `nbytes` random bytes (first touch is slow here: never time it)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Progress:
    """A one-line progress bar on a terminal; periodic log lines otherwise."""

    def __init__(self, total: float, label: str, every_s: float = 5.0) -> None:
        self.total, self.label, self.every_s = total, label, every_s
        self._tty = sys.stderr.isatty()
        self._last = 0.0

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


def emit(suite: str, metrics: dict[str, Any], ratios: dict[str, float], as_json: bool,
         notes: str = "") -> None:
    """Print a readable table, then (with --json) the one-line JSON object last."""
    print(f"kvpool bench {suite}" + (f" ({notes})" if notes else ""))
    width = max((len(k) for k in [*metrics, *ratios]), default=10)
    for k, v in metrics.items():
        print(f"  {k:<{width}}  {v}")
    for k, v in ratios.items():
        print(f"  {k:<{width}}  {v:.2f}x")
    if as_json:
        rounded = {k: round(v, 3) for k, v in ratios.items()}
        print(json.dumps({"suite": suite, "metrics": metrics, "ratios": rounded}))
