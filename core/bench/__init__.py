"""`kvpool bench SUITE`: suites register here by module path; `kvpool bench compare A B` sets two runs side by side.

Every suite shares the `--quick --json --report DIR` contract: the last line printed under `--json`
is one JSON object `{"suite", "metrics", "ratios"}`, each ratio measured against a baseline in the
same run; `--report` writes the results and plots (`report.py`). A suite adds its own options with
`add_arguments(parser)` and ends its `run(args)` with `emit()`. A face's suite lives next to its code
(`kvpool.streams.bench_suite`, `kvpool.backends.bench_suite`) and builds on what this package exports.
"""
from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
from collections.abc import Callable

from ..errors import ConfigError, PoolUnavailable
from ..procs import WorkerProcess
from ..registry import Subparsers, add_unavailable, load
from . import compare, raw_socket, report, yuanrong_peer
from .bench_pool import BenchPool, local_cluster, wait_members
from .measure import best_in_turns, emit, filled, gbps, percentiles_us

__all__ = ["SUITES", "BenchPool", "WorkerProcess", "add_parser", "best_in_turns", "emit", "filled", "gbps",
           "local_cluster", "percentiles_us", "raw_socket", "wait_members", "yuanrong_peer"]

SUITES: dict[str, str] = {
    "core": "kvpool.core.bench.core_suite",
    "cache": "kvpool.core.bench.cache_suite",
    "kvtest": "kvpool.core.bench.kvtest_suite",
    "transport": "kvpool.core.bench.transport_suite",
    "scale": "kvpool.core.bench.scale_suite",
    "gpu": "kvpool.core.bench.gpu_suite",
    "streams": "kvpool.streams.bench_suite",
    "backends": "kvpool.backends.bench_suite",
    "engines": "kvpool.backends.engines.bench",
}
"""Suites by module path (`registry`), imported when the parser is built; a suite that cannot be
imported is listed as unavailable and says why when run."""


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help="run a benchmark suite, or compare two runs")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, module in SUITES.items():
        try:
            mod = load(module)
        except ConfigError as e:
            add_unavailable(suites, name, str(e), "kvpool bench")
            continue
        p = suites.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        p.add_argument("--quick", action="store_true", help="a short run (under 45 s on 2 cores)")
        p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
        p.add_argument("--report", metavar="DIR",
                       help="write results.json and PNG plots to DIR (pip install -e '.[report]')")
        mod.add_arguments(p)
        p.set_defaults(func=functools.partial(_run, mod.run))
    compare.add_parser(suites).set_defaults(func=functools.partial(_run, compare.run))
    return bench


def _run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a bench command with its --report honoured. A bad option or an unreachable pool is one
    line on stderr and exit status 2, not a traceback. SIGTERM (what `timeout` sends) unwinds as Ctrl-C
    does: the suite's workers, servers and temporary folders go with it (exit status 130)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
    try:
        with report.requested(getattr(args, "report", None)):
            return command(args)
    except (ConfigError, PoolUnavailable, report.ReportUnavailable) as e:
        print(f"kvpool bench {args.suite}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvpool bench {args.suite}: interrupted", file=sys.stderr)
        return 130
    finally:
        if main and previous is not None:  # (None: a handler set outside Python, which stays)
            signal.signal(signal.SIGTERM, previous)
