"""A worker's connection thread polls for the next request of a same-node client's burst instead of
sleeping (`WorkerConfig.poll_us`), only for a client in another process, and never with poll_us=0."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvpool.core.client import PoolClient
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import ConfigError
from kvpool.core.server import Worker

N, SIZE = 64, 16 << 10


def _worker(tmp_path: Path, poll_us: float) -> Worker:
    return Worker(WorkerConfig(port=0, unix_path=str(tmp_path / "w.sock"), poll_us=poll_us),
                  CacheConfig(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False)).start()  # type: ignore[arg-type]


def _bursts_from_child(sock: str, rounds: int) -> None:
    """Put 64 blocks of 16 KiB, then get them back `rounds` times in batches of 8, from another process;
    fails unless every get returns the bytes put."""
    code = textwrap.dedent(f"""
        import numpy as np
        from kvpool.core.client import PoolClient
        with PoolClient(mode="local", worker={sock!r}) as c:
            keys = [f"k{{i}}" for i in range({N})]
            blocks = [np.full({SIZE}, i, dtype=np.uint8) for i in range({N})]
            c.batch_put(keys, blocks)
            out = [np.empty({SIZE}, dtype=np.uint8) for _ in range({N})]
            for _ in range({rounds}):
                for i in range(0, {N}, 8):
                    assert c.batch_get_into(keys[i:i + 8], out[i:i + 8]) == [{SIZE}] * 8
                assert all((o == i).all() for i, o in enumerate(out))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _polled(w: Worker) -> float:
    return w.metrics.polled_requests._value.get()


def test_a_burst_from_another_process_is_taken_by_polling(tmp_path: Path) -> None:
    w = _worker(tmp_path, 500)
    try:
        _bursts_from_child(w.unix_path, 50)
        assert _polled(w) > 0
        assert w.cache.check() == []
    finally:
        w.stop()


def test_no_poll_with_poll_us_0(tmp_path: Path) -> None:
    w = _worker(tmp_path, 0)
    try:
        _bursts_from_child(w.unix_path, 50)
        assert _polled(w) == 0
    finally:
        w.stop()


def test_no_poll_for_a_client_in_the_workers_own_process(tmp_path: Path) -> None:
    """Its thread would wait for the GIL the polling thread holds: each request up to poll_us later."""
    w = _worker(tmp_path, 500)
    try:
        with PoolClient(mode="local", worker=w.unix_path) as c:
            keys = [f"k{i}" for i in range(N)]
            c.batch_put(keys, [np.full(SIZE, i, dtype=np.uint8) for i in range(N)])
            out = [np.empty(SIZE, dtype=np.uint8) for _ in range(8)]
            for _ in range(200):
                c.batch_get_into(keys[:8], out)
        assert _polled(w) == 0
    finally:
        w.stop()


@pytest.mark.parametrize("bad", [-1, 20_000])
def test_poll_us_out_of_range_is_a_config_error(bad: float) -> None:
    with pytest.raises(ConfigError, match="poll_us"):
        WorkerConfig(poll_us=bad)


def test_a_client_whose_polls_find_nothing_is_polled_for_ever_less_often(tmp_path: Path) -> None:
    """A prefill producer's stager sends a pin, a commit and the next slots together once a layer: they
    look like a burst, and the next layer comes later than poll_us. 60 layers 3 ms apart cost 60 empty
    polls without the back-off; with it, about one per doubling (chances 1, 3, 7, 15, 31: 5 or 6)."""
    w = _worker(tmp_path, 500)
    code = textwrap.dedent(f"""
        import time
        import numpy as np
        from kvpool.core.client import PoolClient
        from kvpool.core.shm_stage import Stagers
        with PoolClient(mode="local", worker={w.unix_path!r}) as c:
            stagers = Stagers(c)
            block = np.full({SIZE}, 7, dtype=np.uint8)
            for i in range(60):
                names = [f"layer{{i}}".encode()]
                stager = stagers.for_keys(names, [{SIZE}])
                assert stager is not None
                stager.put(names, [memoryview(block)], 60.0)
                time.sleep(0.003)
            stagers.settle()
            stagers.close()
    """)
    try:
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        empty = w.metrics.empty_polls._value.get()
        assert 1 <= empty <= 8, empty
        assert w.cache.check() == []
    finally:
        w.stop()
