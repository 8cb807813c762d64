"""A private temporary folder for an engine run, removed when the run ends.

vLLM and SGLang create their ZMQ/IPC sockets and temporary files under the temporary folder and leave
them there when their processes are stopped: hundreds of `/tmp/<uuid>` and `/tmp/tmpXXXXXXXX` sockets
after a day of runs. An engine driver runs the engine (and every process it starts) with `TMPDIR`
pointing at a folder of its own, and removes that folder on every exit path it controls. torch's
compile cache (`TORCHINDUCTOR_CACHE_DIR`) stays where torch keeps it by default: it is a cache.
"""
from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["private_tmp"]


@contextmanager
def private_tmp(env: dict[str, str] | None = None) -> Iterator[str]:
    """Make a folder under the current temporary folder, point `TMPDIR` (of this process and of
    `env`, the environment given to child processes) at it, and remove it afterwards."""
    # torch's compile cache is a cache, not a leftover: keep it where torch puts it by default
    cache = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(),
                                                                          f"torchinductor_{getpass.getuser()}"))
    path = tempfile.mkdtemp(prefix="kvpe-")
    saved_env, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
    if env is not None:
        env["TMPDIR"] = path
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
    try:
        yield path
    finally:
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(path, ignore_errors=True)
