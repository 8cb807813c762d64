"""Rows for docs/BENCHMARKS.md from saved runs, and its `machine:` line.

    python docs/bench_table.py runs/*.txt     # each a saved `kvpool bench SUITE --json` output (or results.json)

prints the machine line, then per run its suite, its ratios and its metrics as Markdown table rows,
to paste into BENCHMARKS.md (the headline figures) or to read against it.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

from kvpool.core import KVPoolError
from kvpool.core.bench.compare import load


def machine() -> str:
    """CPUs, memory, GPU and the checkout's commit: the `machine:` line of BENCHMARKS.md."""
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no torch"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "?"
    return (f"machine: {os.cpu_count()} CPUs ({model}), {mem:.0f} GiB, {gpu}, Linux {platform.release()}, "
            f"Python {platform.python_version()}, kvpool {commit}")


def main(paths: list[str]) -> int:
    print(machine())
    for path in paths:
        try:
            run = load(path)
        except KVPoolError as e:
            print(f"bench_table: {e}", file=sys.stderr)
            return 2
        print(f"\n### {run['suite']} ({path})")
        if "skipped" in run:
            print(f"skipped: {run['skipped']}")
        print("| figure | value |\n|---|---|")
        for name, ratio in run["ratios"].items():
            print(f"| `{name}` | {ratio:.2f}x |")
        for name, value in run["metrics"].items():
            print(f"| `{name}` | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
