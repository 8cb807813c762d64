"""Fixtures of the bench tests: `bench(*argv)` runs `kvpool bench ...` in this process."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpool.core.cli import build_parser

from benchhelp import Ran


@pytest.fixture
def bench(capsys: pytest.CaptureFixture[str]) -> Callable[..., Ran]:
    def run(*argv: str) -> Ran:
        args = build_parser().parse_args(["bench", *argv])
        rc = args.func(args)
        captured = capsys.readouterr()
        return Ran(rc, captured.out, captured.err)
    return run
