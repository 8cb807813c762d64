"""`kvpool bench compare A B`: two runs side by side, metric by metric and ratio by ratio.

A run is a `--report` directory's `results.json`, or any file whose last line is a `--json` line
(`kvpool bench cache --json > a.txt`), so runs saved either way can be compared.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..registry import Subparsers
from .report import RESULTS, ratio_text

__all__ = ["add_parser", "load", "table", "run"]


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="print two runs (--json output or --report results) side by side")
    p.add_argument("a", help="the first run: a results.json, a --report directory, or saved --json output")
    p.add_argument("b", help="the second run, shown against the first")
    return p


def load(path: str | Path) -> dict[str, Any]:
    """The run saved at `path`: {"suite", "metrics", "ratios", ...}."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read run {str(p)!r}: {e.strerror}") from e
    lines = [line for line in text.splitlines() if line.strip()]
    for candidate in (text, lines[-1] if lines else ""):
        try:
            run = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(run, dict) and {"suite", "metrics", "ratios"} <= set(run):
            return run
    raise ConfigError(f"{str(p)!r} is not a kvpool bench run: expected a JSON object with suite, metrics "
                      "and ratios (a --report results.json, or output whose last line is the --json line)")


def _change(a: Any, b: Any) -> str:
    """B against A: a relative change for numbers, "differs" for other values, blank when equal."""
    if a is None or b is None or a == b:
        return ""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        return f"{(b - a) / abs(a):+.1%}" if a else "from 0"
    return "differs"


def _cell(value: Any, section: str) -> str:
    return "-" if value is None else ratio_text(value) if section == "ratios" else str(value)


def table(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> list[str]:
    """Rows of the side-by-side table (metrics, then ratios), each with B's change against A."""
    rows = [("", names[0], names[1], "change")]
    for section in ("metrics", "ratios"):
        keys = list(dict.fromkeys([*a[section], *b[section]]))
        rows.append((f"[{section}]", "", "", ""))
        for k in keys:
            va, vb = a[section].get(k), b[section].get(k)
            rows.append((k, _cell(va, section), _cell(vb, section), _change(va, vb)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}".rstrip()
            for r in rows]


def run(args: argparse.Namespace) -> int:
    a, b = load(args.a), load(args.b)
    print(f"A: {args.a} ({a['suite']})\nB: {args.b} ({b['suite']})")
    if a["suite"] != b["suite"]:
        print(f"note: different suites ({a['suite']} vs {b['suite']}): only shared names line up")
    print("\n".join(table(a, b, ("A", "B"))))
    return 0
