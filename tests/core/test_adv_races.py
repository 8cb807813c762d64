"""Races inside one TieredCache (an adversarial check): reads against overwrites and flushes, and
close() against threads still at work. Each interleaving is forced with a patched hook and Events."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.core import TieredCache
from kvpool.core.errors import KVPoolError
from kvpool.core.tier_moves import TierMoves
from kvpool.core.tiers.ssd import SsdStore

from corehelp import SMALL, KiB, close_while_held, in_thread, payload

HERE = Path(__file__).resolve().parent


# Bug: a promotion that read SSD while the key was overwritten (another size) and flushed takes the
# newer copy for corrupt and drops it (tier_moves.promote: drop_ssd(k, "corrupt")): a flushed block is lost.
def test_a_read_promoting_an_old_copy_does_not_drop_the_newer_copy_flushed_meanwhile(
        ssd_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dict(SMALL, ssd_path=ssd_dir, ssd_sync=False)
    with TieredCache(**cfg) as c:
        c.put("k", payload("k/1", 10 * KiB))
        c.flush()
    cache = TieredCache(**cfg)  # "k" is on SSD only: a read promotes it
    try:
        real_read = SsdStore.read
        entered, go = threading.Event(), threading.Event()

        def read(store: SsdStore, key: bytes, sink: Any) -> Any:
            if threading.current_thread().name == "reader":
                entered.set()
                go.wait(10)  # the reader has sized its slot for the old copy; it reads after the overwrite
            return real_read(store, key, sink)

        monkeypatch.setattr(SsdStore, "read", read)
        reader, got = in_thread(lambda: cache.get("k"), "reader")
        assert entered.wait(10)
        cache.put("k", payload("k/2", 20 * KiB))
        assert cache.flush() == 1  # promised: a restart serves it from SSD
        go.set()
        reader.join(10)
        assert got and got[0] in (None, payload("k/1", 10 * KiB), payload("k/2", 20 * KiB))
        assert cache.get("k") == payload("k/2", 20 * KiB)
    finally:
        cache.close()
    with TieredCache(**cfg) as again:
        assert again.get("k") == payload("k/2", 20 * KiB), "the flushed block was lost"


# Bug: a read that took its lease before close() and copies after it raises a raw ValueError
# ("operation forbidden on released memoryview object"), not PoolClosed (cache.py _readable/_get_into).
@pytest.mark.parametrize("op", ["get", "get_into", "lease"])
def test_a_read_racing_close_raises_a_kvpool_error(make_cache: Callable[..., TieredCache],
                                                   monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    cache = make_cache()
    cache.put("k", payload("k", 10 * KiB))
    real_verified = TierMoves.verified
    entered, go = threading.Event(), threading.Event()

    def verified(moves: TierMoves, b: Any) -> bool:
        if threading.current_thread().name == "reader":
            entered.set()
            go.wait(10)  # leased; close() runs now
        return real_verified(moves, b)

    monkeypatch.setattr(TierMoves, "verified", verified)

    def read() -> Any:
        if op == "get":
            return cache.get("k")
        if op == "get_into":
            return cache.get_into("k", bytearray(20 * KiB))
        with cache.lease("k") as view:
            return None if view is None else bytes(view)

    got = close_while_held(cache, read, "reader", entered, go)
    assert not isinstance(got, BaseException) or isinstance(got, KVPoolError), repr(got)


# Bug: a put that reserved its slot before close() and copies after it raises a raw TypeError
# ("'NoneType' object is not subscriptable": the closed arena's buf), not PoolClosed (cache.py _write).
def test_a_put_racing_close_raises_a_kvpool_error(make_cache: Callable[..., TieredCache],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache()
    real_reserve = TieredCache._reserve
    entered, go = threading.Event(), threading.Event()

    def reserve(c: TieredCache, n: int) -> int:
        offset = real_reserve(c, n)
        if threading.current_thread().name == "writer":
            entered.set()
            go.wait(10)  # the slot is ours; close() runs now
        return offset

    monkeypatch.setattr(TieredCache, "_reserve", reserve)
    got = close_while_held(cache, lambda: cache.put("k", payload("k", 10 * KiB)), "writer", entered, go)
    assert not isinstance(got, BaseException) or isinstance(got, KVPoolError), repr(got)


def _run_child(script: str, ssd_dir: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
    head = f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
    try:
        return subprocess.run([sys.executable, "-c", head + textwrap.dedent(script), ssd_dir],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung (over {timeout} s): {e.stdout!r} {e.stderr!r}")


# Bug: close() while a flush() writes on another thread hangs forever: close holds the cache's lock
# while LMDB's env.close waits for the flush's write transaction, and the flush waits for the lock
# (tier_stack.close / cache.close do not wait for SSD writes in flight, tier_moves.demote).
def test_close_while_a_flush_writes_returns(ssd_dir: str) -> None:
    script = """
    import threading, time
    from kvpool.core import TieredCache
    import kvpool.core.tiers.ssd as ssdmod
    from corehelp import KiB, SMALL, in_thread, payload
    cache = TieredCache(**SMALL, ssd_path=sys.argv[1], ssd_sync=False)
    for i in range(8):
        cache.put(f"k{i}", payload(f"k{i}", 16 * KiB))
    in_txn, closing = threading.Event(), threading.Event()
    real_header, real_close = ssdmod.encode_header, TieredCache.close
    def header(meta):  # called inside the flush's write transaction
        if not in_txn.is_set():
            in_txn.set()
            closing.wait(10)
            time.sleep(0.5)  # close() is well under way by now
        return real_header(meta)
    def close(c):
        closing.set()
        real_close(c)
    ssdmod.encode_header = header
    TieredCache.close = close
    t, result = in_thread(cache.flush, "flush")
    assert in_txn.wait(10)
    cache.close()
    t.join(10)
    print("closed", result, flush=True)
    """
    done = _run_child(script, ssd_dir, timeout=15)
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr[-2000:]


# Bug: close() while a get() promotes a block from SSD crashes the process (SIGSEGV): the reader copies
# from a view of LMDB's map outside the cache's lock (tier_moves.promote -> SsdStore.read) and close()
# unmaps it under the reader (cache.close does not wait for SSD reads in flight).
def test_close_while_a_get_reads_ssd_does_not_crash(ssd_dir: str) -> None:
    script = """
    import threading
    from kvpool.core import TieredCache
    import kvpool.core.tiers.ssd as ssdmod
    from kvpool.core.errors import KVPoolError
    from corehelp import KiB, SMALL, in_thread, payload
    cfg = dict(SMALL, ssd_path=sys.argv[1], ssd_sync=False)
    with TieredCache(**cfg) as c:
        c.put("k", payload("k", 256 * KiB))
        c.flush()
    cache = TieredCache(**cfg)  # "k" on SSD only: a get promotes it
    in_read, closed = threading.Event(), threading.Event()
    real_decode = ssdmod.decode
    def decode(value):  # inside the read transaction: `value` is a view of LMDB's map
        in_read.set()
        closed.wait(10)
        return real_decode(value)
    ssdmod.decode = decode
    t, result = in_thread(lambda: cache.get("k"), "get")
    assert in_read.wait(10)
    cache.close()
    closed.set()
    t.join(10)
    r = result[0] if result else "hung"
    assert r is None or r == payload("k", 256 * KiB) or isinstance(r, KVPoolError), repr(r)
    print("ok", flush=True)
    """
    done = _run_child(script, ssd_dir)
    assert done.returncode == 0 and "ok" in done.stdout, f"rc {done.returncode}: {done.stderr[-2000:]}"
