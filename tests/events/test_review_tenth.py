"""Tenth review: the fork serialization and page-walk pipe of 0dc8b00 (core/cache.py, core/tiers/ssd.py) and
the boot/stop announcements and re-announcement of c1e07ec (core/events.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from kvpool.core import TieredCache
from kvpool.core.events import EventBatch, EventIndex, EventPublisher

SMALL = dict(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False)


def _script(body: str, timeout: float = 60) -> str:
    """Run `body` in a fresh interpreter; its stdout+stderr (a hang shows as the missing last line)."""
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as e:
        return f"timed out after {timeout} s: {e.stdout!r} {e.stderr!r}"
    return proc.stdout + proc.stderr


# Bug: walk_pages' parent waits on its pipe with select.select (core/tiers/ssd.py _walk_verdict), which cannot take
# a descriptor >= 1024: in a process with many files open (an engine: sockets, shm, CUDA) every cache whose SSD
# tier must scan (a new one included) fails with a raw ValueError("filedescriptor out of range in select()").
def test_a_cache_opens_its_ssd_tier_in_a_process_with_many_files_open() -> None:
    out = _script("""
        import os, resource, tempfile
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]  # the next fds are past 1023
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
    assert "opened scan" in out, f"a new SSD tier opened where fds past 1023 are in use: {out[-2000:]}"


# Bug: _before_fork (core/cache.py) takes the module lock `_forking` before the caches' locks; a thread that forks
# while it holds a cache's lock (a listener told under it, or any code inside a cache callback) now waits for
# `_forking`, held by another thread's fork that waits for that very cache lock: both forks and the cache hang for
# ever (before 0dc8b00 the RLock let the holder fork).
def test_a_fork_under_the_caches_lock_while_another_thread_forks_does_not_hang() -> None:
    out = _script("""
        import os, threading, time
        from kvpool.core import TieredCache
        from kvpool.core.cache_events import CacheListener
        cache = TieredCache(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False)
        inside, res = threading.Event(), []
        class ForksUnderLock(CacheListener):  # told under the cache's lock
            def stored(self, key, tier):
                if key == b"slow":
                    inside.set(); time.sleep(1.0)  # another thread's fork waits for the cache's lock meanwhile
                    pid = os.fork()
                    if pid == 0:
                        os._exit(0)
                    os.waitpid(pid, 0); res.append("listener")
        cache.add_listener(ForksUnderLock())
        def other():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0); res.append("other")
        t1 = threading.Thread(target=cache.put, args=("slow", b"x" * 10), daemon=True); t1.start()
        assert inside.wait(10)
        t2 = threading.Thread(target=other, daemon=True); t2.start()
        t1.join(6); t2.join(2)
        got = []
        t3 = threading.Thread(target=lambda: got.append(cache.get("slow")), daemon=True); t3.start(); t3.join(2)
        print("forked", sorted(res), "get", got, flush=True)
        os._exit(0)
    """)
    assert "forked ['listener', 'other'] get [b'xxxxxxxxxx']" in out, f"two forks, one under the lock: {out[-2000:]}"


# Bug: events dropped because the EventQueue was full count in `lost` but are never followed by a re-announce
# (core/events.py EventPublisher.flush sets `_reannounce` only when a sink fails), though the module docstring
# promises the holdings are re-announced "after any loss": a consumer never learns of blocks the worker holds
# (and, for removals lost the same way, keeps blocks it does not). The boot announcement itself is bounded the
# same way (MAX_QUEUED: a restart's SSD tier of over 1M blocks is announced in part, for good).
def test_events_the_full_queue_dropped_are_re_announced() -> None:
    cache = TieredCache(**SMALL)
    got: list[EventBatch] = []
    pub = EventPublisher(cache, "w1", "n1", [got.append], flush_s=3600)
    try:
        pub.flush()
        pub.queue.max_queued = 4  # (scaled down: a burst past MAX_QUEUED between two flushes)
        keys = [f"k{i}".encode() for i in range(12)]
        for k in keys:
            cache.put(k, b"x" * 64)
        pub.queue.max_queued = 1 << 20
        for _ in range(3):
            pub.flush()
        index = EventIndex()
        for batch in got:
            index.apply(batch)
        assert got[-1].lost > 0, "the queue's overflow is counted in lost"
        missing = [k for k in keys if "w1" not in index.workers(k)]
        assert not missing, f"after a loss, {len(missing)} of the worker's blocks were never re-announced: {missing}"
    finally:
        pub.close()
        cache.close()
