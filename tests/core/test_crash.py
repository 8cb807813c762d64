"""kill -9 a writer mid-load: every block it reported committed is readable with exact bytes, and
nothing readable has wrong bytes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.core import TieredCache
from kvpool.core.tiers.dram import arena_names
from kvpool.core.tiers.ssd import SsdStore

from corehelp import payload

HERE = Path(__file__).resolve().parent

# Keys name their size ("<prefix><n>-<size>") so a reader can derive the expected bytes from the key.
_PRELUDE = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from corehelp import payload
SIZES = [0, 1, 4096, 10_000, 64 * 1024, 150_000, 300 * 1024]
def key_of(i):
    return f"blk{{i}}-{{SIZES[(i * 7919) % len(SIZES)]}}"
"""

CACHE_WRITER = _PRELUDE + """
from kvpool.core import TieredCache
cache = TieredCache(dram_bytes=4 << 20, dram_slab_size=1 << 20, prefault=False,
                    ssd_path=sys.argv[1], ssd_sync=False, ssd_map_size=1 << 30)
i = 0
while True:
    keys = [key_of(i + j) for j in range(8)]
    cache.batch_put(keys, [payload(k, int(k.rsplit("-", 1)[1])) for k in keys])
    cache.flush()  # every DRAM block without an SSD copy is committed now
    for k in keys:
        print(k, flush=True)
    i += 8
"""

TIER_WRITER = _PRELUDE + """
from kvpool.core.blocks import BlockMeta, checksum
from kvpool.core.tiers.ssd import SsdStore
tier = SsdStore(sys.argv[1], map_size=1 << 30, sync=False)
i = 0
while True:
    keys = [key_of(i + j) for j in range(16)]
    items = []
    for k in keys:
        data = payload(k, int(k.rsplit("-", 1)[1]))
        items.append((k.encode(), BlockMeta(len(data), checksum(data)), memoryview(data)))
    tier.batch_put(items)
    for k in keys:
        print(k, flush=True)
    i += 16
"""


def expected(key: str | bytes) -> bytes:
    k = key.decode() if isinstance(key, bytes) else key
    return payload(k, int(k.rsplit("-", 1)[1]))


def run_and_kill(script: str, path: Path, min_committed: int) -> list[str]:
    """Run `script` until it has reported `min_committed` keys, SIGKILL it, return what it reported."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    committed: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while len(committed) < min_committed:
            line = proc.stdout.readline()
            if not line:
                assert proc.stderr is not None
                pytest.fail(f"writer exited early (rc {proc.wait()}): {proc.stderr.read()[-2000:]}")
            committed.append(line.strip())
            assert time.monotonic() < deadline, "writer is too slow"
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=30)
        # lines flushed before the kill landed were committed too
        committed.extend(line for line in rest.splitlines() if line.strip())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        for name in arena_names(proc.pid):  # the killed writer could not unlink its arena
            os.unlink(f"/dev/shm/{name}")
    assert proc.returncode == -signal.SIGKILL
    return committed


def test_kill_9_during_cache_demotion_and_flush(tmp_path: Path, make_cache: Callable[..., TieredCache]) -> None:
    path = tmp_path / "ssd"
    committed = run_and_kill(CACHE_WRITER, path, min_committed=400)
    cache = make_cache(ssd_path=str(path), ssd_sync=False, dram_bytes=64 << 20)
    for k in committed:
        assert cache.get(k) == expected(k), f"committed block {k} is lost or wrong"
    assert cache.ssd is not None
    stored = [k for k, _ in cache.ssd.store.scan()]
    assert len(stored) >= len(committed)
    for k in stored:  # blocks written but not yet reported are complete or absent, never wrong
        got = cache.get(k)
        assert got is None or got == expected(k)
    assert cache.stats().checksum_failures == 0


def test_kill_9_during_ssd_batches(tmp_path: Path) -> None:
    path = tmp_path / "ssd"
    committed = run_and_kill(TIER_WRITER, path, min_committed=800)
    tier = SsdStore(path, map_size=1 << 30)
    try:
        for k in committed:
            assert tier.read(k.encode(), lambda m, v: bytes(v)) == expected(k), k
        stored = dict(tier.scan())
        assert len(stored) >= len(committed) and len(stored) % 16 == 0  # whole batches only
        for k in stored:
            got = tier.read(k, lambda m, v: bytes(v))
            assert got == expected(k)
        assert tier.corrupt == 0
    finally:
        tier.close()
