"""Helpers of the worker security tests: run Python as another Unix user (`nobody`), and open
folders a test made so that only the permissions under test protect what is in them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

NOBODY = 65534


def need_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a child as nobody")


def as_nobody(imports: str, body: str, *args: str, env: dict[str, str] | None = None,
              timeout: float = 60) -> Any:
    """Run `imports` as this user (the interpreter and kvpool may live where nobody cannot read),
    then drop to nobody (setuid) and run `body`, which prints one JSON line: returned decoded."""
    need_root()
    code = (textwrap.dedent(imports) + "\nimport encodings.idna, json, os, sys\nos.setgroups([])\nos.setgid(65534)\n"
            "os.setuid(65534)\nassert os.getuid() == 65534\n" + textwrap.dedent(body))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-3000:]
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


@contextmanager
def open_folder() -> Iterator[Path]:
    """A fresh folder anyone may enter (0755; pytest's own are 0700), so that only the permissions under
    test protect what a worker keeps in it. Removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="kvpool-sec-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def dump(obj: Any) -> str:
    return json.dumps(obj)
