"""Helpers shared by the core tests (a plain module, so tests and child scripts can import it)."""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np

MiB = 1 << 20
KiB = 1 << 10

SMALL = dict(dram_bytes=32 * MiB, dram_slab_size=1 * MiB, prefault=False)
"""A small arena that is quick to create; tests that need other sizes override these."""


def payload(key: str | bytes, size: int) -> bytes:
    """Deterministic, non-periodic bytes for (`key`, `size`): a reader can check a block without
    remembering what was put, and a copy at a wrong offset does not match."""
    k = key.encode() if isinstance(key, str) else bytes(key)
    seed = int.from_bytes(hashlib.sha256(k + size.to_bytes(8, "little")).digest()[:8], "little")
    return np.random.default_rng(seed).bytes(size)


def in_thread(call: Callable[[], Any], name: str) -> tuple[threading.Thread, list[Any]]:
    """Run `call` in a thread named `name`; its result or exception lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as e:  # reported by the test
            out.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, out


def close_while_held(cache: Any, call: Callable[[], Any], name: str, entered: threading.Event,
                     go: threading.Event) -> Any:
    """Run `call` in thread `name`, which a patched hook holds (it sets `entered`, then waits for `go`);
    close `cache` meanwhile, let the call go on, and return what it returned or raised."""
    t, got = in_thread(call, name)
    assert entered.wait(10)
    cache.close()
    go.set()
    t.join(10)
    assert got, f"the {name} hung"
    return got[0]


def worker_commit_columns(meta: bytes, reserved: dict[Any, Any], arena: Any, check: bool, top: int) -> Any:
    """The worker's own Python path of a COMMIT's read (`RequestHandlers._commit_columns`, the extension's
    call set aside, versions capped at `top` as of a clock whose ceiling it is): what the C call must
    agree with; None where it refuses the request."""
    from kvpool.core import protocol as P
    from kvpool.core import versions, worker_ops
    from kvpool.core.errors import KVPoolError

    handlers = SimpleNamespace(cache=SimpleNamespace(arena=SimpleNamespace(buf=arena)))
    with mock.patch.object(worker_ops, "_native_commit_columns", None), \
            mock.patch.object(versions, "ceiling", lambda: top):
        try:
            return worker_ops.RequestHandlers._commit_columns(
                handlers, SimpleNamespace(reserved=reserved), P.Frame(P.Op.COMMIT, 0, 0, meta, 0), check)  # type: ignore[arg-type]
        except KVPoolError:
            return None
