"""A remove that waits for an SSD write of one of its keys (`TierStack.remove` -> `await_writes`) lets
go of the cache's lock in the middle, and only then queues its keys' SSD copies for deletion. A key
put again and demoted to SSD while it waited has its new copy queued too: the remove deletes the newer
block's LMDB record (its index entry stays), and the acknowledged put is a miss (counted as a
checksum failure).

Sequence (all real paths: `flush` on a SIGTERM, the demoter, batch_remove, put):
  flush writes `j` (held in its transaction); the demoter writes `k` v1 (held);
  batch_remove([j, k]) waits for both; k's write ends; put k v2; the demoter writes k v2 to SSD
  and evicts it from DRAM; j's write ends: the remove marks [j, k] stale and deletes them."""
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


def test_a_remove_that_waited_does_not_delete_a_newer_copy_written_meantime(
        make_cache: Callable[..., TieredCache], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(ssd_path=str(tmp_path / "ssd"))
    stack = cache._stack
    gates = {b"j": (threading.Event(), threading.Event()), b"k": (threading.Event(), threading.Event())}
    original = SsdStore.batch_put

    def batch_put(store: SsdStore, items):  # type: ignore[no-untyped-def]
        items = list(items)
        for key, (entered, go_on) in gates.items():
            if any(k == key for k, _, _ in items) and not entered.is_set():
                entered.set()
                assert go_on.wait(20)
        return original(store, items)

    monkeypatch.setattr(SsdStore, "batch_put", batch_put)
    fillers: list[str] = []

    def fill_until(done: Callable[[], bool]) -> None:
        for _ in range(4000):
            if done():
                return
            name = f"f{len(fillers)}"
            cache.put(name, payload(name, SIZE))
            fillers.append(name)
            time.sleep(0.0005)
        raise AssertionError("the demoter never got there")

    cache.put("j", payload("j", SIZE))
    flusher = threading.Thread(target=cache.flush, daemon=True)
    flusher.start()
    assert gates[b"j"][0].wait(10)  # flush's transaction of j in flight
    cache.put("k", payload("k-v1", SIZE))
    fill_until(gates[b"k"][0].is_set)  # the demoter's transaction of k v1 in flight

    remover = threading.Thread(target=lambda: cache.batch_remove(["j", "k"]), daemon=True)
    remover.start()
    remover.join(0.3)
    assert remover.is_alive()  # waiting for both writes

    gates[b"k"][1].set()  # k v1's write ends
    deadline = time.monotonic() + 10
    while b"k" in stack.writing and time.monotonic() < deadline:
        time.sleep(0.01)
    cache.put("k", payload("k-v2", SIZE))  # acknowledged
    for name in fillers:  # k v2 becomes the least recently used block the demoter can take
        cache.get(name)
    fill_until(lambda: stack.ssd is not None and b"k" in stack.ssd and b"k" not in stack.dram.blocks)

    gates[b"j"][1].set()  # j's write ends: the remove goes on
    remover.join(10)
    flusher.join(10)
    assert not remover.is_alive() and not flusher.is_alive()
    got = cache.get("k")
    now = "a miss" if got is None else "other bytes"
    assert got == payload("k-v2", SIZE), f"the put of k v2 returned, and k is now {now}"
