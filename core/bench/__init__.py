"""`kvpool bench SUITE`: suites register here by name and are imported only when run.

Every suite shares the `--quick --json` contract: the last line printed under `--json` is one JSON
object `{"suite", "metrics", "ratios"}`, each ratio measured against a baseline in the same run.
"""
from __future__ import annotations

import argparse
import importlib

SUITES: dict[str, str] = {
    "core": "kvpool.core.bench.core_suite",
    "cache": "kvpool.core.bench.cache_suite",
    "transport": "kvpool.core.bench.transport_suite",
    "streams": "kvpool.core.bench.streams_suite",
}


def add_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    bench = sub.add_parser("bench", help="run a benchmark suite")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, module in SUITES.items():
        mod = importlib.import_module(module)
        p = suites.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        p.add_argument("--quick", action="store_true", help="a short run (under 45 s on 2 cores)")
        p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
