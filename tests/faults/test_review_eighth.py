"""Eighth review: the fork handlers of TieredCache (84ea32e), its finalizer (bf7d971) and the forked walk of
an SSD tier's pages at a start that scans (9ed9bb7)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpool.core import PoolClient, TieredCache

SMALL = dict(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False)


def _script(body: str, timeout: float = 60) -> str:
    """Run `body` in a fresh interpreter (imports in its own order, signals of its own); its stdout+stderr."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc.stdout + proc.stderr


def _in_child(run) -> str:  # type: ignore[no-untyped-def]
    """Fork; the child runs `run()` and sends back its str (or the exception's repr); os._exit either way."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            try:
                out = str(run())
            except BaseException as e:
                out = f"raised {e!r}"
            os.write(w, out.encode()[:60000])
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        return f.read().decode()


# Bug: two threads that fork at once share one module-level `_held` list (core/cache.py _before_fork): the first
# fork's after-in-parent handler clears it while the second thread waits in its before handler, so the second
# takes the cache's lock and never releases it: every later call on the parent's cache hangs for ever.
def test_two_threads_forking_at_once_leave_the_parents_cache_usable() -> None:
    out = _script("""
        import concurrent.futures.thread  # (imported before kvpool, as in any engine: its fork lock runs after ours)
        import os, threading, time
        from kvpool.core import TieredCache
        from kvpool.core.cache_events import CacheListener
        cache = TieredCache(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False)
        go, inside, done = threading.Event(), threading.Event(), threading.Event()
        class Slow(CacheListener):  # a put that holds the cache's lock a while (a listener told under it)
            def stored(self, key, tier):
                if key == b"slow":
                    inside.set(); go.wait(20)
        cache.add_listener(Slow())
        threading.Thread(target=cache.put, args=("slow", b"x" * 10), daemon=True).start()
        assert inside.wait(10)
        forked = []
        def fork():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0); forked.append(pid)
            done.wait(30)  # (alive: a dead thread's ident, reused, would own its lock)
        for _ in range(2):
            threading.Thread(target=fork, daemon=True).start()
        time.sleep(1.0)  # both forks wait for the cache's lock
        go.set()
        deadline = time.monotonic() + 10
        while len(forked) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = []
        t = threading.Thread(target=lambda: got.append(cache.get("slow")), daemon=True)
        t.start(); t.join(10)
        print("forks", len(forked), "get", got)
        done.set()
        os._exit(0)
    """)
    assert "forks 2 get [b'xxxxxxxxxx']" in out, f"the parent's cache after two concurrent forks: {out[-2000:]}"


# Bug: TierStack.forked zeroes every lease in the child (DramTier.forked), the forking thread's own included:
# a view from `lease` held across fork() is of a block the child may evict and whose slot it reuses (README:
# "The block is neither evicted nor freed while the lease is held"); the child reads other blocks' bytes.
def test_a_lease_held_across_fork_keeps_its_bytes_in_the_child() -> None:
    pool = PoolClient(**SMALL)
    try:
        pool.put("a", b"A" * 65536)
        with pool.lease("a") as view:
            def child() -> str:
                for i in range(600):  # 37 MiB through a 16 MiB pool: it evicts and reuses slots
                    pool.put(f"c{i}", bytes([i % 251 + 1]) * 65536)
                return "intact" if bytes(view) == b"A" * 65536 else f"now {bytes(view[:4])!r}..."
            got = _in_child(child)
        assert got == "intact", f"a leased block's view in the forked child reads: {got}"
    finally:
        pool.close()


# Bug: the same zeroed lease goes negative when the forking thread releases it in the child: the child's cache
# reports itself broken (check: "-1 leases"; stats().dram_leases == -1).
def test_a_lease_released_in_the_forked_child_leaves_its_cache_consistent() -> None:
    cache = TieredCache(**SMALL)
    try:
        cache.put("a", b"A" * 4096)
        ref = cache.acquire("a")
        assert ref is not None

        def child() -> str:
            cache.release(ref)  # the lease this very thread took before the fork
            return f"{cache.check()} leases={cache.stats().dram_leases}"
        got = _in_child(child)
        cache.release(ref)
        assert got == "[] leases=0", f"the forked child's cache after its lease ended: {got}"
    finally:
        cache.close()


# Bug: the child's stack drops its SSD tier (TierStack.forked) but keeps DRAM blocks marked on_ssd, so the
# child's check() (documented "empty when it is consistent") reports "DRAM blocks claim an SSD copy but there
# is no SSD tier" for a cache nothing is wrong with.
def test_a_forked_childs_check_of_a_flushed_cache_is_empty(tmp_path: Path) -> None:
    cache = TieredCache(**SMALL, ssd_path=str(tmp_path / "ssd"))
    try:
        cache.put("a", b"A" * 4096)
        cache.flush()
        got = _in_child(lambda: cache.check())
        assert got == "[]", f"check() in the forked child: {got}"
        assert cache.check() == []
    finally:
        cache.close()


# Bug: the cache's finalizer (core/cache.py _close) may run on its own demoter thread (a collection runs where
# an allocation triggers it, the demoter's included): it joins the thread it runs on (RuntimeError "cannot join
# current thread" printed, stack.close() skipped: no index saved, the next start scans) or, inside a demotion,
# waits for that demotion's own write for ever (wait_for_ssd): the demoter hangs, the dropped cache keeps its SSD
# folder, and a new cache on it is refused ("in use by another cache of this process"), what bf7d971 set out to end.
@pytest.mark.parametrize("hook", ["dropped", "copied"])
def test_a_cache_collected_on_its_demoter_thread_lets_go_of_its_ssd_folder(hook: str) -> None:
    out = _script(f"""
        import gc, os, tempfile, threading
        from kvpool.core import TieredCache
        from kvpool.core.cache_events import CacheListener
        from kvpool.core.errors import KVPoolError
        path = tempfile.mkdtemp() + "/ssd"
        cfg = dict(dram_bytes=8 << 20, dram_slab_size=1 << 20, prefault=False, ssd_path=path,
                   high_watermark=0.5, low_watermark=0.3)
        go, inside = threading.Event(), threading.Event()
        class CollectOnDemoter(CacheListener):  # stands for a collection the demoter's allocations trigger
            def {hook}(self, key, tier, *why):
                if threading.current_thread().name == "kvpool-demoter" and not inside.is_set():
                    inside.set(); go.wait(10); gc.collect()
        gc.disable()
        cache = TieredCache(**cfg)
        cache.add_listener(CollectOnDemoter())
        cycle = {{"cache": cache}}; cycle["cycle"] = cycle  # dropped in a reference cycle
        for i in range(80):
            cache.put(f"k{{i}}", bytes([i]) * 65536)
        assert inside.wait(10), "no demotion"
        del cache, cycle
        go.set()
        done = threading.Event()
        def reopen():
            for _ in range(50):
                try:
                    TieredCache(**cfg).close(); print("reopened"); break
                except KVPoolError as e:
                    last = e; threading.Event().wait(0.1)
            else:
                print("refused:", last)
            done.set()
        threading.Thread(target=reopen, daemon=True).start()
        done.wait(20)
        os._exit(0)
    """)
    assert "reopened" in out and "Exception ignored" not in out, \
        f"a cache collected on its demoter thread (in {hook}): {out[-2500:]}"


# Bug: walk_pages (core/tiers/ssd.py) reaps its forked child with os.waitpid, which raises ChildProcessError
# where the process ignores SIGCHLD (children reaped by the kernel; inherited across exec from a supervisor):
# every cache with an SSD tier that must scan (a new, empty one included) fails with a raw OSError.
def test_a_cache_opens_its_ssd_tier_where_sigchld_is_ignored() -> None:
    out = _script("""
        import signal, tempfile
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        from kvpool.core import TieredCache
        from kvpool.core.errors import KVPoolError
        try:
            cache = TieredCache(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False,
                                ssd_path=tempfile.mkdtemp() + "/ssd")
            print("opened", cache.ssd.opened_from); cache.close()
        except KVPoolError as e:
            print("typed", type(e).__name__, e)
        except BaseException as e:
            print("untyped", repr(e))
    """)
    assert "opened scan" in out, f"a new SSD tier where SIGCHLD is ignored: {out[-2000:]}"
