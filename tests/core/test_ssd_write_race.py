"""A put, remove or clear of a key whose older block is being written to SSD outside the cache's lock
(the demoter's batch, or `flush`'s), and a kill -9 right after.

The README promises that a replaced key's old SSD copy is deleted before the put that replaced it
returns, and a removed key's before the remove returns, so that a kill -9 leaves a miss, never the
older version. While the older block's write was in flight it was not yet in the SSD tier's index, so
the put (or remove, or clear) found nothing to delete and returned; the write then committed the old
bytes, queued for deletion only at the demoter's next turn, and a kill -9 in between left the old copy
served after a restart. The change now waits for that write and deletes what it landed.

A kill is simulated at each instant after the change returned: a copy of the SSD folder (what LMDB
would hold if the process died then) is opened as a fresh tier."""
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


@pytest.mark.parametrize("change", ["put", "remove", "clear"])
def test_a_change_made_while_the_old_block_is_flushed_survives_a_kill_right_after(
        make_cache: Callable[..., TieredCache], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    ssd_dir = tmp_path / "ssd"
    cache = make_cache(ssd_path=str(ssd_dir))
    cache.put("k", payload("k-v1", SIZE))

    in_write, go_on, returned = threading.Event(), threading.Event(), threading.Event()
    kills: list[Path] = []  # copies of the SSD folder at instants after the change returned: a kill -9 there

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
            if returned.is_set():  # the change was acknowledged before the older block landed
                kill_now("killed-after-write")
            return written
        return original(store, items)

    def make_the_change() -> None:
        if change == "put":
            cache.put("k", payload("k-v2", SIZE))
        elif change == "remove":
            assert cache.remove("k")
        else:
            cache.clear()  # (waits for the write under way too, and deletes what it lands)
        returned.set()  # acknowledged
        kill_now("killed-after-return")

    monkeypatch.setattr(SsdStore, "batch_put", batch_put)
    flusher = threading.Thread(target=cache.flush)  # the SIGTERM path; the demoter's batches go the same way
    flusher.start()
    assert in_write.wait(10)
    changer = threading.Thread(target=make_the_change)
    changer.start()
    changer.join(0.3)  # it returns now, or waits for the write in flight
    go_on.set()
    changer.join(10)
    flusher.join(10)
    monkeypatch.setattr(SsdStore, "batch_put", original)
    assert returned.is_set() and not changer.is_alive() and not flusher.is_alive()
    assert cache.get("k") == (payload("k-v2", SIZE) if change == "put" else None)  # the live cache is right
    assert kills
    for folder in kills:
        again = make_cache(ssd_path=str(folder))  # the worker restarted on what the kill left
        stale = again.get("k") == payload("k-v1", SIZE)
        assert not stale, f"after the {change} returned and a kill -9 ({folder.name}), the restarted tier serves " \
            "the older block"


def test_a_put_during_a_long_flush_waits_for_no_batch_but_its_keys(
        make_cache: Callable[..., TieredCache], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush writes in batches (one transaction each): a put of a key whose batch was written already
    returns while a later batch is still being written."""
    from kvpool.core import tier_moves

    cache = make_cache(ssd_path=str(tmp_path / "ssd"))
    for k in ("a", "b"):
        cache.put(k, payload(f"{k}-v1", SIZE))
    monkeypatch.setattr(tier_moves, "_FLUSH_BATCH_BYTES", SIZE)  # a batch a block
    second, go_on = threading.Event(), threading.Event()
    original, calls = SsdStore.batch_put, []

    def batch_put(store: SsdStore, items):  # type: ignore[no-untyped-def]
        items = list(items)
        calls.append([k for k, _, _ in items])
        if len(calls) == 2:
            second.set()
            assert go_on.wait(10)
        return original(store, items)

    monkeypatch.setattr(SsdStore, "batch_put", batch_put)
    flusher = threading.Thread(target=cache.flush)
    flusher.start()
    try:
        assert second.wait(10)
        (first_key,) = calls[0]
        done = threading.Event()
        threading.Thread(target=lambda: (cache.put(first_key.decode(), payload("v2", SIZE)), done.set())).start()
        assert done.wait(5), "the put waited for a batch that did not hold its key"
    finally:
        go_on.set()
        flusher.join(10)
    assert cache.get(first_key.decode()) == payload("v2", SIZE)
