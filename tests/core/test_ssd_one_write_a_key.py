"""Two SSD writes of one key: `flush` writes k v1 (outside the lock); k is put again (v2), and the
demoter would write v2 while v1's write is still in flight. Had it (two writes of a key at once), v1's
write, ending first, would queue k for deletion (its block is no longer live and k not indexed yet)
after v2's write withdrew k's pending deletions, and the put of v2, waiting for both writes, would
delete v2's own fresh copy: once v2 left DRAM, the acknowledged put a miss and the index out of step.
A write of a key now waits for one under way."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.core import TieredCache
from kvpool.core.tiers.ssd import SsdStore

from corehelp import payload

SIZE = 64 << 10


def test_a_put_that_waited_for_two_writes_of_its_key_keeps_its_own_copy(
        make_cache: Callable[..., TieredCache], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(ssd_path=str(tmp_path / "ssd"))
    stack = cache._stack
    entered, go_on = threading.Event(), threading.Event()
    original, writes = SsdStore.batch_put, []

    def batch_put(store: SsdStore, items):  # type: ignore[no-untyped-def]
        items = list(items)
        if any(k == b"k" for k, _, _ in items):
            writes.append(threading.current_thread().name)
            if len(writes) == 1:
                entered.set()
                assert go_on.wait(20)
        return original(store, items)

    monkeypatch.setattr(SsdStore, "batch_put", batch_put)
    cache.put("k", payload("k-v1", SIZE))
    flusher = threading.Thread(target=cache.flush, daemon=True)
    flusher.start()
    assert entered.wait(10)  # write 1: k v1, by flush
    putter = threading.Thread(target=lambda: cache.put("k", payload("k-v2", SIZE)), daemon=True)
    putter.start()
    deadline = time.monotonic() + 10
    while stack.dram.blocks.get(b"k") is None or stack.dram.blocks[b"k"].version == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    n = 0
    for n in range(600):  # 37 MiB, past the arena: the demoter takes k v2 (the oldest it may) meanwhile
        cache.put(f"f{n}", payload(f"f{n}", SIZE))
    assert len(writes) == 1, "a second write of k began while the first was under way"
    go_on.set()
    putter.join(10)
    flusher.join(10)
    assert not putter.is_alive() and not flusher.is_alive()
    deadline = time.monotonic() + 10
    while b"k" in stack.dram.blocks and time.monotonic() < deadline:  # v2 leaves DRAM (with its SSD copy)
        n += 1
        cache.put(f"f{n}", payload(f"f{n}", SIZE))
    assert cache.check() == []
    assert cache.get("k") == payload("k-v2", SIZE)
