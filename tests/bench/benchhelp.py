"""Helpers shared by the bench tests: small cache-run options and the --json contract of a run."""
from __future__ import annotations

import json
from typing import Any

SMALL = ["--block-size", "64KiB", "--key-pool-size", "64", "--inference-delay-ms", "0"]
"""Options that keep a cache run small: the tests check behaviour, never speed."""


class Ran:
    """A finished `kvpool bench ...`: exit status, stdout, stderr."""

    def __init__(self, rc: int, out: str, err: str) -> None:
        self.rc, self.out, self.err = rc, out, err

    @property
    def json(self) -> dict[str, Any]:
        """The --json contract: the last stdout line is the result object."""
        return dict(json.loads(self.out.strip().splitlines()[-1]))
