"""A worker process serving clients in other processes: shared memory on the node, TCP otherwise."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.core import BufferSizeError, PoolUnavailable
from kvpool.core.client import PoolClient
from kvpool.core.connection import Connection


def _block(i: int, size: int = 64 << 10) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def _put_from_child(worker: str, n: int, size: int) -> None:
    code = textwrap.dedent(f"""
        import numpy as np
        from kvpool.core.client import PoolClient
        c = PoolClient(mode="local", worker={worker!r})
        blocks = [np.random.default_rng(i).integers(0, 256, {size}, dtype=np.uint8) for i in range({n})]
        c.batch_put([f"k{{i}}" for i in range({n})], blocks)
        c.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_put_in_one_process_get_in_another_through_shared_memory(spawn):
    w = spawn()
    _put_from_child(w.unix_path, 16, 64 << 10)
    with PoolClient(mode="local", worker=w.unix_path) as c:
        arena = c.backend.arena  # type: ignore[attr-defined]  # a ShmTransport
        base = np.frombuffer(arena, dtype=np.uint8).ctypes.data
        with c.batch_lease([f"k{i}" for i in range(16)] + ["absent"]) as views:
            assert views[-1] is None
            for i, v in enumerate(views[:-1]):
                assert bytes(v) == _block(i)
                addr = np.frombuffer(v, dtype=np.uint8).ctypes.data
                assert base <= addr and addr + len(v) <= base + len(arena), "the view is not in the arena"
                assert v.readonly


def test_a_leased_view_kept_past_its_lease_cannot_be_read(spawn):
    """A view used after its lease ended could read a slot the worker gave to another block since: it
    is released as the block exits (ValueError on use), unless the caller exported it (a numpy array
    over it, which then holds it as it was)."""
    w = spawn()
    with PoolClient(mode="local", worker=w.unix_path) as c:
        c.put("k", b"x" * 4096)
        with c.batch_lease(["k"]) as views:
            kept = views[0]
            assert kept is not None and bytes(kept) == b"x" * 4096
        with pytest.raises(ValueError):
            bytes(kept)


def test_remote_get_over_tcp_is_byte_exact(spawn):
    w = spawn()
    _put_from_child(w.address, 8, 1 << 20)
    with PoolClient(mode="local", worker=w.address) as c:
        bufs = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(9)]
        sizes = c.batch_get_into([f"k{i}" for i in range(8)] + ["nope"], bufs)
        assert sizes == [1 << 20] * 8 + [-1]
        for i in range(8):
            assert bufs[i].tobytes() == _block(i, 1 << 20)
        with pytest.raises(BufferSizeError, match="1048576 bytes; the destination holds 100"):
            c.batch_get_into(["k0"], [bytearray(100)])
        assert c.get("k1") == _block(1, 1 << 20)  # the connection is still in sync


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_batch_ops(spawn, transport):
    w = spawn()
    with PoolClient(mode="local", worker=w.unix_path if transport == "shm" else w.address) as c:
        keys = [f"{transport}-{i}" for i in range(64)]
        c.batch_put(keys, [_block(i, 4096 + i) for i in range(64)])
        assert c.batch_exists(keys[:3] + ["x"]) == [True, True, True, False]
        assert c.prefix_match(keys + ["x"] + keys) == 64
        assert c.batch_remove(keys[10:12] + ["x"]) == [True, True, False]
        assert c.prefix_match(keys) == 10
        bufs = [bytearray(8192) for _ in keys]
        sizes = c.batch_get_into(keys, bufs)
        assert sizes[10] == sizes[11] == -1
        assert all(bytes(bufs[i][:4096 + i]) == _block(i, 4096 + i) for i in range(64) if i not in (10, 11))
        assert c.stats().total.dram_blocks == 62
        c.put("other/0", b"stays")
        c.clear(f"{transport}-")
        assert not any(c.batch_exists(keys)) and c.get("other/0") == b"stays"
        c.clear()
        assert c.batch_exists(keys[:1] + ["other/0"]) == [False, False]


def test_worker_gone_is_a_typed_error_in_local_mode(spawn):
    w = spawn()
    c = PoolClient(mode="local", worker=w.address, timeout_s=2)
    c.put("a", b"x")
    w.kill()
    with pytest.raises(PoolUnavailable):
        c.get("a")
    c.close()


def test_sigterm_flushes_dram_to_ssd_and_restart_serves_it(tmp_path):
    from kvpool.core.procs import WorkerProcess

    w = WorkerProcess(tmp_path / "w", ssd=True).wait_ready()
    with PoolClient(mode="local", worker=w.address) as c:
        c.batch_put([f"p{i}" for i in range(10)], [_block(i) for i in range(10)])
    assert w.stop() == 0, w.log_tail()
    w2 = WorkerProcess(tmp_path / "w", ssd=True).wait_ready()
    try:
        with PoolClient(mode="local", worker=w2.address) as c:
            assert [c.get(f"p{i}") for i in range(10)] == [_block(i) for i in range(10)]
    finally:
        w2.kill()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_batches_larger_than_one_frame_are_split_not_refused(spawn, transport):
    """70,000 keys of 400 bytes: more items than one frame may carry, and 28 MB of metadata."""
    w = spawn(dram_bytes="128MiB")
    keys = [f"{i:08d}".encode() * 50 for i in range(70_000)]
    with PoolClient(mode="local", worker=w.unix_path if transport == "shm" else w.address, timeout_s=30) as c:
        c.batch_put(keys, [k[:8] for k in keys])
        assert c.batch_exists(keys) == [True] * len(keys)
        assert c.prefix_match(keys) == len(keys)
        bufs = [bytearray(8) for _ in keys]
        assert c.batch_get_into(keys, bufs) == [8] * len(keys)
        assert all(bytes(b) == k[:8] for b, k in zip(bufs, keys))
        c.batch_pin(keys, 0)
        assert c.batch_remove(keys) == [True] * len(keys)


def _end_a_call_blocked_in_its_handshake(tmp_path, end: Callable[[Connection], None]) -> Connection:
    """A call blocked on a peer that accepts and never answers, in another thread; `end(connection)` from
    this one must end it at once (PoolUnavailable), not at its 5 s timeout. Returns the connection."""
    import socket
    import threading
    import time

    from kvpool.core.transport import connect

    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX) as silent:  # accepts, never answers
        silent.bind(path)
        silent.listen(8)
        t = connect(path, "t" * 32, timeout_s=5)
        ended: list[BaseException] = []

        def call() -> None:
            try:
                t.hello()
            except BaseException as e:  # (what the call ended with is the point)
                ended.append(e)
        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.3)  # in its handshake now, waiting on the silent peer
        start = time.monotonic()
        end(t)
        caller.join(5)
        assert not caller.is_alive() and isinstance(ended[0], PoolUnavailable)
        assert time.monotonic() - start < 1.0, "the call ran on to its timeout"
    return t


def test_an_aborted_connection_fails_at_once_and_never_connects_again(tmp_path):
    """What a call abandoned at its deadline still does stops when its connection is aborted, and the
    connection makes no new one (a paused worker would hold a reconnect for the whole timeout)."""
    t = _end_a_call_blocked_in_its_handshake(tmp_path, Connection.abort)
    with pytest.raises(PoolUnavailable, match="abandoned"):
        t.hello()
    t.close()


def test_closing_a_connection_ends_a_call_blocked_on_it_in_another_thread(tmp_path):
    """A client closing (its read repairs still running) must not leave a call blocked on a closed socket
    until its timeout: on Linux, closing a socket does not wake a receive blocked on it."""
    _end_a_call_blocked_in_its_handshake(tmp_path, Connection.close)


def test_a_worker_keeps_a_pin_until_every_process_that_pinned_it_lets_go(spawn):
    """Two processes pin one block (two prefill instances of one prefix); this one's unpin leaves the
    other's pin in place, which then runs out by itself. Each process is a holder of its own: the
    worker tells them apart by what their connections said at HELLO."""
    import time

    w = spawn(dram_bytes="8MiB", env={"KVPOOL_DRAM_SLAB_SIZE": str(1 << 20)})
    size = 256 << 10
    with PoolClient(mode="local", worker=w.unix_path) as c:
        c.batch_put(["shared"], [_block(0, size)], pin_s=60)
        code = textwrap.dedent(f"""
            from kvpool.core.client import PoolClient
            with PoolClient(mode="local", worker={w.address!r}) as c:  # over TCP: HELLO there too
                c.batch_pin(["shared"], 2.0)
                c.stats()  # PIN has no answer: one that does, after it, says it was taken
        """)
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        c.batch_pin(["shared"], 0)

        def squeeze(tag: str) -> None:
            for i in range(64):  # twice the arena: every block no pin holds is evicted
                c.batch_put([f"filler/{tag}/{i}"], [_block(i + 1, size)])

        squeeze("a")
        assert c.get("shared") == _block(0, size), "another process's pin was ended by this one's unpin"
        time.sleep(2.2)
        squeeze("b")
        assert not c.exists("shared"), "the other process's pin did not run out"
