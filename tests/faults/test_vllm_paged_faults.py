"""The vLLM connector's worker side (`PagedKV` over `HostIO`, as `start_load_kv` / `wait_for_save`
drive it) against a real worker that is paused (SIGSTOP), killed, or restarted empty at the same
address: a load returns a bounded miss, never raises, never writes into vLLM's KV tensors what is not
the block's exact bytes, and the next calls after the worker is back are exact again."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from kvpool.backends._hostio import HostIO
from kvpool.backends._vllm_paged import PagedKV
from kvpool.backends._vllm_plan import namespace, pool_keys
from kvpool.core.client import PoolClient
from kvpool.core.procs import WorkerProcess

from sigstop import freeze

BS, LAYERS, NUM_BLOCKS, HEADS, HEAD_DIM = 32, 3, 12, 2, 64
NS = namespace("llama", "bfloat16", BS, 0, 1, "cpu/FullAttentionSpec/3L/2x32x256")
TOKENS = list(range(1000, 1200))
TIMEOUT_S = 1.0


def _kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def _io(address: str) -> HostIO:
    return HostIO(lambda: PoolClient(mode="local", worker=address, timeout_s=TIMEOUT_S),
                  logger=logging.getLogger("test.ar.vllm"), retry_s=0.2)


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_a_paused_worker_is_a_bounded_miss_and_late_replies_never_land(spawn, via: str) -> None:
    w = spawn()
    io = _io(w.unix_path if via == "unix" else w.address)
    try:
        src, dst = _kv(1), _kv(2)
        a, b = PagedKV(src, NUM_BLOCKS), PagedKV(dst, NUM_BLOCKS)
        keys = pool_keys(TOKENS, BS, NS)[:5]
        assert a.save(io, keys, [0, 1, 2, 3, 4]) == 5
        before = [t.clone() for t in dst]
        freeze(w.proc.pid)
        try:
            t0 = time.monotonic()
            assert b.load(io, keys, [5, 6, 7, 8, 9]) == 0
            assert time.monotonic() - t0 <= TIMEOUT_S + 1.0
            assert all(torch.equal(d, u) for d, u in zip(dst, before))
        finally:
            os.kill(w.proc.pid, signal.SIGCONT)
        time.sleep(0.5)  # past the back-off; whatever the worker now sends for the old request is stale
        got = 0
        deadline = time.monotonic() + 5
        while got < 5 and time.monotonic() < deadline:
            got = b.load(io, keys, [5, 6, 7, 8, 9])
            time.sleep(0.1)
        assert got == 5
        for s, d in zip(src, dst):
            for sb, db in zip([0, 1, 2, 3, 4], [5, 6, 7, 8, 9]):
                assert torch.equal(s[sb], d[db])
    finally:
        io.close()


def test_a_worker_restarted_empty_at_the_same_address_is_a_miss_then_exact(tmp_path: Path) -> None:
    """Same Unix socket path and port, a new process with a new (empty) arena: the adapter's connection
    to the old one must not read the new one's offsets out of the old arena's mapping."""
    w = WorkerProcess(tmp_path / "w", dram_bytes="64MiB").wait_ready()
    io = _io(w.unix_path)
    w2 = None
    try:
        src, dst = _kv(1), _kv(2)
        a, b = PagedKV(src, NUM_BLOCKS), PagedKV(dst, NUM_BLOCKS)
        keys = pool_keys(TOKENS, BS, NS)[:4]
        assert a.save(io, keys, [0, 1, 2, 3]) == 4
        assert b.load(io, keys, [4, 5, 6, 7]) == 4
        w.kill()
        w2 = WorkerProcess(tmp_path / "w", dram_bytes="64MiB", port=w.port).wait_ready()
        before = [t.clone() for t in dst]
        loaded = b.load(io, keys, [8, 9, 10, 11])  # the engine still holds the keys it matched before
        assert loaded == 0
        assert all(torch.equal(d, u) for d, u in zip(dst, before))
        time.sleep(0.3)
        # other bytes under the same keys now: the restarted worker must serve these, not the old arena's
        other = _kv(3)
        c = PagedKV(other, NUM_BLOCKS)
        stored = 0
        deadline = time.monotonic() + 5
        while stored < 4 and time.monotonic() < deadline:
            stored = c.save(io, keys, [0, 1, 2, 3])
            time.sleep(0.1)
        assert stored == 4
        assert b.load(io, keys, [8, 9, 10, 11]) == 4
        for s, d in zip(other, dst):
            for sb, db in zip([0, 1, 2, 3], [8, 9, 10, 11]):
                assert torch.equal(s[sb], d[db])
    finally:
        io.close()
        w.kill()
        if w2 is not None:
            w2.stop(timeout=5)


def test_a_worker_killed_mid_load_leaves_the_kv_untouched_or_exact(spawn) -> None:
    """Kill -9 the worker while loads run in a loop: each load returns at most the blocks it wrote whole,
    and every block it says it loaded holds exactly the saved bytes."""
    w = spawn()
    io = _io(w.unix_path)
    try:
        src = _kv(1)
        a = PagedKV(src, NUM_BLOCKS)
        keys = pool_keys(TOKENS, BS, NS)[:6]
        assert a.save(io, keys, [0, 1, 2, 3, 4, 5]) == 6
        dst = _kv(2)
        b = PagedKV(dst, NUM_BLOCKS, staging_bytes=2 * a.block_bytes)  # 3 chunks: a kill can land between
        results: list[tuple[int, list[torch.Tensor]]] = []
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                for t in dst:
                    t.zero_()
                n = b.load(io, keys, [6, 7, 8, 9, 10, 11])
                results.append((n, [t.clone() for t in dst]))

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.3)
        w.kill()
        time.sleep(0.5)
        stop.set()
        th.join(10)
        assert not th.is_alive()
        assert any(n == 6 for n, _ in results) and any(n < 6 for n, _ in results)
        for n, snap in results:
            for i in range(6):
                for s, d in zip(src, snap):
                    if i < n:
                        assert torch.equal(s[i], d[6 + i])
                    else:
                        assert not d[6 + i].any()
    finally:
        io.close()
