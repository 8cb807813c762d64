"""`--report DIR`: a run's results as `results.json`, and PNG plots drawn from that JSON alone.

matplotlib is an optional extra (`pip install -e '.[report]'`), imported only when a report is
asked for, so `kvpool bench` itself runs on a bare install. The runner sets the directory around a
suite (`requested`), so every suite that ends in `measure.emit()` writes a report without knowing.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ..errors import KVPoolError

__all__ = ["RESULTS", "ratio_text", "ReportUnavailable", "require_matplotlib", "requested", "write_if_requested",
           "write"]

RESULTS = "results.json"


def ratio_text(value: float) -> str:
    """How a ratio reads in a table: two decimals, or two significant digits under 0.1 (a single-block
    call against memcpy of the same bytes reads 0.012x, not 0.01x)."""
    return f"{value:.2f}x" if abs(value) >= 0.1 or value == 0 else f"{value:.2g}x"
_DIR: ContextVar[Path | None] = ContextVar("kvpool_bench_report_dir", default=None)


class ReportUnavailable(KVPoolError, ImportError):
    """`--report` was asked for but matplotlib is not installed."""


def require_matplotlib() -> None:
    """Fail before a run, not after it, when the plots could not be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ReportUnavailable("--report draws its plots with matplotlib, which is not installed: "
                                "pip install -e '.[report]'") from e


@contextmanager
def requested(directory: str | None) -> Iterator[None]:
    """Inside the `with`, `write_if_requested` writes to `directory` (nothing when it is None)."""
    if directory:
        require_matplotlib()
    token = _DIR.set(Path(directory) if directory else None)
    try:
        yield
    finally:
        _DIR.reset(token)


def write_if_requested(results: dict[str, Any]) -> None:
    directory = _DIR.get()
    if directory is not None:
        files = write(directory, results)
        print(f"report: {', '.join(str(f) for f in files)}")


def write(directory: str | Path, results: dict[str, Any]) -> list[Path]:
    """Write `results.json` and every plot the results have data for; the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS).write_text(json.dumps(results, indent=1) + "\n")
    written = [out / RESULTS]
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    for name, draw in _PLOTS.items():
        fig = Figure(figsize=(7, 4), layout="constrained")
        if draw(fig.subplots(), results):
            fig.savefig(out / name, dpi=100)
            written.append(out / name)
    return written


def _series(results: dict[str, Any], column: str) -> tuple[list[float], list[float]]:
    rows = [r for r in results["timeline"] if column in r]
    return [r["t_s"] for r in rows], [r[column] for r in rows]


def _throughput(ax: Any, results: dict[str, Any]) -> bool:
    t, y = _series(results, "gbps")
    ax.plot(t, y)
    ax.set(title=f"{results['suite']}: throughput", xlabel="seconds", ylabel="GB/s")
    return bool(t)


def _latency_cdf(ax: Any, results: dict[str, Any]) -> bool:
    cdf = results["latency_cdf_us"]
    for op, values in cdf.items():
        ax.plot(values, [q / 100 for q in range(len(values))], label=op)
    ax.set(title=f"{results['suite']}: latency CDF", xlabel="microseconds", ylabel="fraction of ops", xscale="log")
    if cdf:
        ax.legend()
    return bool(cdf)


def _hit_rate(ax: Any, results: dict[str, Any]) -> bool:
    t, y = _series(results, "hit_rate")
    ax.plot(t, y, label="per interval")
    ax.plot(*_series(results, "cum_hit_rate"), label="whole run so far")
    if "target_hit_rate" in results["metrics"]:
        ax.axhline(results["metrics"]["target_hit_rate"], linestyle="--", color="gray", label="target")
    ax.set(title=f"{results['suite']}: hit rate", xlabel="seconds", ylabel="hits / gets", ylim=(0, 1.05))
    ax.legend()
    return bool(t)


def _tier_fill(ax: Any, results: dict[str, Any]) -> bool:
    columns = sorted({k for r in results["timeline"] for k in r if k.endswith("_bytes")})
    for c in columns:
        t, y = _series(results, c)
        ax.plot(t, [v / 2**20 for v in y], label=c.removesuffix("_bytes"))
    if columns and "dram_capacity" in results["metrics"]:
        ax.axhline(results["metrics"]["dram_capacity"] / 2**20, linestyle="--", color="gray", label="dram capacity")
    ax.set(title=f"{results['suite']}: tier fill", xlabel="seconds", ylabel="MiB")
    if columns:
        ax.legend()
    return bool(columns)


_PLOTS: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "throughput.png": _throughput,
    "latency_cdf.png": _latency_cdf,
    "hit_rate.png": _hit_rate,
    "tier_fill.png": _tier_fill,
}
