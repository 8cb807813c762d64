"""The `mooncake` shim directory: put it first on PYTHONPATH and `from mooncake.store import
MooncakeDistributedStore` gives kvpool's drop-in (`kvpool.backends.mooncake_compat`) for that process
tree. Other `mooncake` modules (e.g. `mooncake.engine`) still come from a real Mooncake if installed.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: importing the shim package loads nothing of core
    from kvpool.core import Subparsers


def shim_path() -> str:
    """The directory to prepend to PYTHONPATH (it holds the `mooncake` shim package)."""
    return str(Path(__file__).resolve().parent)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """`kvpool mooncake-shim`: print the PYTHONPATH entry, e.g. `PYTHONPATH=$(kvpool mooncake-shim)`."""
    p = subparsers.add_parser(
        "mooncake-shim", help="print a PYTHONPATH entry that makes `mooncake.store` resolve to kvpool",
        description="Prints the directory of kvpool's `mooncake` shim package. With it first on PYTHONPATH, "
                    "`from mooncake.store import MooncakeDistributedStore` gives kvpool's drop-in, e.g. "
                    "PYTHONPATH=$(kvpool mooncake-shim)${PYTHONPATH:+:$PYTHONPATH} python -m ...")
    p.set_defaults(func=_cmd)
    return p


def _cmd(args: argparse.Namespace) -> int:
    print(shim_path())
    return 0
