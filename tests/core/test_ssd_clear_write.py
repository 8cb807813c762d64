"""`clear()` (every key) made while a block is being written to SSD outside the lock, and a kill -9
right after: the gap 4e743ce closed for put and remove (and so for clear(prefix), which removes) is
open for a whole clear. `TierStack.clear` empties LMDB and returns without waiting for the write in
flight, which then commits the cleared block; it is only queued for deletion (`mark_stale`), so a kill
before the demoter's next turn leaves it in LMDB and the restarted tier serves it.

The kill is simulated as in tests/core/test_ssd_write_race.py: a copy of the SSD folder taken at an
instant after the clear returned."""
from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.core import TieredCache
from kvpool.core.tiers.ssd import SsdStore

from corehelp import payload

SIZE = 64 << 10


def test_a_clear_made_while_a_block_is_flushed_survives_a_kill_right_after(
        make_cache: Callable[..., TieredCache], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ssd_dir = tmp_path / "ssd"
    cache = make_cache(ssd_path=str(ssd_dir))
    cache.put("k", payload("k-v1", SIZE))
    in_write, go_on, returned = threading.Event(), threading.Event(), threading.Event()
    kills: list[Path] = []

    def kill_now(name: str) -> None:
        shutil.copytree(ssd_dir, tmp_path / name, ignore=shutil.ignore_patterns("kvpool.lock"))
        kills.append(tmp_path / name)

    original = SsdStore.batch_put

    def batch_put(store: SsdStore, items):  # type: ignore[no-untyped-def]
        items = list(items)
        if any(k == b"k" for k, _, _ in items) and not in_write.is_set():
            in_write.set()
            assert go_on.wait(10)
            written = original(store, items)
            if returned.is_set():
                kill_now("killed-after-write")
            return written
        return original(store, items)

    def clear() -> None:
        cache.clear()
        returned.set()
        kill_now("killed-after-return")

    monkeypatch.setattr(SsdStore, "batch_put", batch_put)
    flusher = threading.Thread(target=cache.flush)
    flusher.start()
    assert in_write.wait(10)
    changer = threading.Thread(target=clear)
    changer.start()
    changer.join(0.3)
    go_on.set()
    changer.join(10)
    flusher.join(10)
    monkeypatch.setattr(SsdStore, "batch_put", original)
    assert returned.is_set() and not changer.is_alive() and not flusher.is_alive()
    assert cache.get("k") is None
    for folder in kills:
        again = make_cache(ssd_path=str(folder))
        assert again.get("k") is None, f"after clear() returned and a kill -9 ({folder.name}), the restarted " \
            "tier serves the cleared block"
