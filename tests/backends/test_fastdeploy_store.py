"""KVPoolStore against FastDeploy's KVCacheStorage contract, driven with raw pointers into host buffers
laid out as FastDeploy's cache transfer manager lays out its staging buffers."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvpool.core.errors as errors_module
from kvpool.backends._hostio import STATUS_OF_ERROR, Status, status_of
from kvpool.backends.fastdeploy import KVPoolStore
from kvpool.core.client import PoolClient
from kvpool.core.errors import KVPoolError, PoolUnavailable

from bkhelp import SMALL_POOL, HostBuffer, fastdeploy_keys, payload


class Layout:
    """FastDeploy's staging buffers for `blocks` blocks: one read and one write buffer, each [K blocks |
    V blocks] of `stride` bytes, plus (block_wise_fp8) two scale buffers of `scale_stride` bytes per block."""

    def __init__(self, store: KVPoolStore, blocks: int, stride: int, scale_stride: int = 0,
                 kind: str = "numpy") -> None:
        self.blocks, self.stride, self.scale_stride = blocks, stride, scale_stride
        self.write = HostBuffer(2 * blocks * stride, kind)
        self.read = HostBuffer(2 * blocks * stride, kind)
        store.register_buffer(self.read.ptr, self.read.nbytes)
        store.register_buffer(self.write.ptr, self.write.nbytes)
        self.scale_write = self.scale_read = None
        if scale_stride:
            self.scale_read = HostBuffer(2 * blocks * scale_stride, kind)
            self.scale_write = HostBuffer(2 * blocks * scale_stride, kind)
            store.register_buffer(self.scale_read.ptr, self.scale_read.nbytes)
            store.register_buffer(self.scale_write.ptr, self.scale_write.nbytes)

    def args(self, keys: list[list[str]], buf: str, ids: list[int] | None = None) -> dict[str, Any]:
        """batch_set / batch_get keyword arguments, built as `_run_read_storage` builds them."""
        ids = list(range(self.blocks)) if ids is None else ids
        main = self.read if buf == "read" else self.write
        half = self.blocks * self.stride
        locs = [main.ptr + i * self.stride for i in ids] + [main.ptr + half + i * self.stride for i in ids]
        sizes = [self.stride] * 2 * len(ids)
        if len(keys) == 4:
            sc = self.scale_read if buf == "read" else self.scale_write
            assert sc is not None
            shalf = self.blocks * self.scale_stride
            locs += [sc.ptr + i * self.scale_stride for i in ids]
            locs += [sc.ptr + shalf + i * self.scale_stride for i in ids]
            sizes += [self.scale_stride] * 2 * len(ids)
        return {"keys": [k for group in keys for k in group], "target_locations": locs, "target_sizes": sizes}

    def fill_write(self) -> None:
        self.write.array[:] = payload("write", self.write.nbytes)
        if self.scale_write is not None:
            self.scale_write.array[:] = payload("scale", self.scale_write.nbytes)

    def assert_read_equals_write(self, blocks: int | None = None, scales: bool = True) -> None:
        n = self.blocks if blocks is None else blocks
        half = self.blocks * self.stride
        for base in (0, half):
            span = slice(base, base + n * self.stride)
            assert np.array_equal(self.read.array[span], self.write.array[span])
        if scales and self.scale_read is not None and self.scale_write is not None:
            shalf = self.blocks * self.scale_stride
            for base in (0, shalf):
                span = slice(base, base + n * self.scale_stride)
                assert np.array_equal(self.scale_read.array[span], self.scale_write.array[span])


@pytest.fixture
def store() -> Iterator[KVPoolStore]:
    s = KVPoolStore(namespace="ERNIE-4.5-0.3B-Paddle", tp_rank=0, tp_size=1, **SMALL_POOL)
    yield s
    s.close()


# bf16 block: 4 layers x 2 kv heads x 16 tokens x 64 head_dim x 2 bytes; fp8: 1 byte, scales 4 bytes per token-head
BF16_STRIDE = 4 * 2 * 16 * 64 * 2
FP8_STRIDE = 4 * 2 * 16 * 64 * 1
FP8_SCALE_STRIDE = 4 * 2 * 16 * 4


def test_bf16_round_trip_every_byte(store: KVPoolStore) -> None:
    lay = Layout(store, blocks=6, stride=BF16_STRIDE)
    lay.fill_write()
    keys = fastdeploy_keys([f"h{i:02d}" for i in range(6)], rank=0)
    assert store.batch_set(**lay.args(keys, "write")) == [0] * 12
    assert store.query(keys[0], keys[1], None, None, 1.0) == 6
    assert store.exists(keys[0] + keys[1]) == dict.fromkeys(keys[0] + keys[1], True)
    assert store.batch_get(**lay.args(keys, "read")) == [BF16_STRIDE] * 12
    lay.assert_read_equals_write()


def test_block_wise_fp8_round_trip_with_torch_buffers(store: KVPoolStore) -> None:
    pytest.importorskip("torch")
    lay = Layout(store, blocks=5, stride=FP8_STRIDE, scale_stride=FP8_SCALE_STRIDE, kind="torch")
    lay.fill_write()
    keys = fastdeploy_keys([f"blk{i}" for i in range(5)], rank=1, prefix="RL-STEP7", scales=True)
    assert keys[2][0] == "prefixRL-STEP7_blk0_1_key_scale" and keys[3][0] == "prefixRL-STEP7_blk0_1_value_scale"
    assert store.batch_set(**lay.args(keys, "write")) == [0] * 20
    assert store.query(*keys, 1.0) == 5
    got = store.batch_get(**lay.args(keys, "read"))
    assert got == [FP8_STRIDE] * 10 + [FP8_SCALE_STRIDE] * 10
    lay.assert_read_equals_write()


def test_query_counts_only_leading_complete_blocks(store: KVPoolStore) -> None:
    lay = Layout(store, blocks=5, stride=FP8_STRIDE, scale_stride=FP8_SCALE_STRIDE)
    lay.fill_write()
    keys = fastdeploy_keys([f"q{i}" for i in range(5)], scales=True)
    assert store.query(*keys) == 0
    assert store.batch_set(**lay.args(keys, "write")) == [0] * 20
    assert store.delete(keys[1][3])                      # block 3 loses its V
    assert store.query(keys[0], keys[1]) == 3
    assert store.query(*keys) == 3
    assert store.delete(keys[3][1])                      # block 1 loses its V scale
    assert store.query(keys[0], keys[1]) == 3            # without scales block 1 is still whole
    assert store.query(*keys) == 1
    assert store.query(keys[0], keys[1], keys[2], None) == 3  # one scale list alone: scales not checked
    assert store.query([], []) == 0
    # the read that follows a partial match: present blocks hit, the missing one is a miss, bytes exact
    got = store.batch_get(**lay.args(keys[:2], "read"))
    assert got[:5] == [FP8_STRIDE] * 5 and got[5:8] == [FP8_STRIDE] * 3
    assert got[8] == Status.OBJECT_NOT_FOUND and got[9] == FP8_STRIDE
    lay.assert_read_equals_write(blocks=3, scales=False)
    assert not store.delete(keys[1][3])                  # already gone
    assert store.exists([keys[0][3], keys[1][3]]) == {keys[0][3]: True, keys[1][3]: False}


def test_get_and_set_of_one_key(store: KVPoolStore) -> None:
    lay = Layout(store, blocks=1, stride=BF16_STRIDE)
    lay.fill_write()
    assert store.set("prefix_one_0_key", lay.write.ptr, BF16_STRIDE) == 0
    assert store.get("prefix_one_0_key", lay.read.ptr, BF16_STRIDE) == BF16_STRIDE
    assert store.get("prefix_two_0_key", lay.read.ptr, BF16_STRIDE) == Status.OBJECT_NOT_FOUND
    assert np.array_equal(lay.read.at(0, BF16_STRIDE), lay.write.at(0, BF16_STRIDE))


@pytest.mark.parametrize("call", ["batch_set", "batch_get"])
def test_empty_or_mismatched_lists_raise_value_error(store: KVPoolStore, call: str) -> None:
    lay = Layout(store, blocks=2, stride=BF16_STRIDE)
    fn = getattr(store, call)
    with pytest.raises(ValueError, match="empty"):
        fn(keys=[], target_locations=[], target_sizes=[])
    with pytest.raises(ValueError, match="2 keys, 1 target_locations and 2 target_sizes"):
        fn(keys=["a", "b"], target_locations=[lay.write.ptr], target_sizes=[8, 8])
    with pytest.raises(ValueError, match="required"):
        fn(keys=["a"])
    with pytest.raises(ValueError):
        store.query(["a", "b"], ["a"])
    with pytest.raises(ValueError):
        store.query(["a"], ["b"], ["c", "d"], ["e"])
    with pytest.raises(ValueError):
        store.register_buffer(0, 4096)
    with pytest.raises(ValueError):
        store.register_buffer(lay.write.ptr, 0)


def test_pointer_outside_registered_buffers_is_a_per_item_error(store: KVPoolStore,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    lay = Layout(store, blocks=2, stride=BF16_STRIDE)
    lay.fill_write()
    stray = HostBuffer(BF16_STRIDE)  # never registered
    end = lay.write.ptr + lay.write.nbytes
    keys = ["prefix_a_0_key", "prefix_b_0_key", "prefix_c_0_key", "prefix_d_0_key", "prefix_e_0_key"]
    locs = [lay.write.ptr, stray.ptr, end - BF16_STRIDE // 2, lay.write.ptr + BF16_STRIDE, lay.write.ptr]
    sizes = [BF16_STRIDE, BF16_STRIDE, BF16_STRIDE, BF16_STRIDE, 0]
    with caplog.at_level(logging.WARNING, logger="kvpool.backends.fastdeploy"):
        got = store.batch_set(keys=keys, target_locations=locs, target_sizes=sizes)
        again = store.batch_set(keys=keys, target_locations=locs, target_sizes=sizes)
    bad = Status.INVALID_PARAMS
    assert got == again == [0, bad, bad, 0, bad]
    assert sum("not inside a registered buffer" in r.getMessage() for r in caplog.records) == 1
    assert store.exists(keys) == dict(zip(keys, [True, False, False, True, False]))
    out = store.batch_get(keys=keys[:1] + keys[3:4], target_locations=[stray.ptr, lay.read.ptr],
                          target_sizes=[BF16_STRIDE, BF16_STRIDE])
    assert out == [bad, BF16_STRIDE]
    assert np.array_equal(lay.read.at(0, BF16_STRIDE), lay.write.at(BF16_STRIDE, BF16_STRIDE))


def test_destination_smaller_than_block_fails_only_that_key(store: KVPoolStore) -> None:
    lay = Layout(store, blocks=3, stride=BF16_STRIDE)
    lay.fill_write()
    keys = fastdeploy_keys(["s0", "s1", "s2"])
    assert store.batch_set(**lay.args(keys, "write")) == [0] * 6
    args = lay.args(keys, "read")
    args["target_sizes"][1] = BF16_STRIDE - 1
    got = store.batch_get(**args)
    assert got == [BF16_STRIDE, Status.INVALID_PARAMS] + [BF16_STRIDE] * 4
    assert np.array_equal(lay.read.at(0, BF16_STRIDE), lay.write.at(0, BF16_STRIDE))
    assert np.array_equal(lay.read.at(3 * BF16_STRIDE, 3 * BF16_STRIDE), lay.write.at(3 * BF16_STRIDE, 3 * BF16_STRIDE))


def test_block_larger_than_the_pool_takes_fails_only_that_key(store: KVPoolStore) -> None:
    big = HostBuffer(2 * (1 << 20))  # the small pool's max block is 1 MiB
    store.register_buffer(big.ptr, big.nbytes)
    big.array[:] = payload("big", big.nbytes)
    got = store.batch_set(keys=["prefix_ok_0_key", "prefix_big_0_key"], target_locations=[big.ptr, big.ptr],
                          target_sizes=[4096, big.nbytes])
    assert got == [0, Status.INVALID_PARAMS]
    assert store.exists(["prefix_ok_0_key", "prefix_big_0_key"]) == {"prefix_ok_0_key": True, "prefix_big_0_key": False}


def test_namespaces_keep_models_apart() -> None:
    with PoolClient(**SMALL_POOL) as pool:
        a, b = KVPoolStore(namespace="model-a", client=pool), KVPoolStore(namespace="model-b", client=pool)
        buf = HostBuffer(4096)
        buf.array[:] = payload("ns", 4096)
        for s in (a, b):
            s.register_buffer(buf.ptr, buf.nbytes)
        assert a.batch_set(keys=["prefix_h_0_key"], target_locations=[buf.ptr], target_sizes=[4096]) == [0]
        assert a.exists(["prefix_h_0_key"]) == {"prefix_h_0_key": True}
        assert b.exists(["prefix_h_0_key"]) == {"prefix_h_0_key": False}
        assert pool.batch_exists(["model-a/tp1/prefix_h_0_key"]) == [True]  # model, TP size (, KV dtype)
        assert b.clear() and a.exists(["prefix_h_0_key"]) == {"prefix_h_0_key": False}  # clear is pool-wide
        a.close()
        assert pool.batch_exists(["x"]) == [False]  # a store does not close a client it was given


def _assert_down_behaviour(store: KVPoolStore, lay: Layout, keys: list[list[str]]) -> None:
    t0 = time.monotonic()
    assert store.batch_set(**lay.args(keys, "write")) == [Status.RPC_FAIL] * 2 * lay.blocks
    got = store.batch_get(**lay.args(keys, "read"))
    assert all(n <= 0 for n in got)
    assert store.exists(keys[0]) == dict.fromkeys(keys[0], False)
    assert store.query(keys[0], keys[1]) == 0
    assert store.delete(keys[0][0], timeout=0.3) is False
    assert store.clear() is False
    assert time.monotonic() - t0 < 3.0


def test_pool_down_reports_misses_and_logs_once(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpool.backends.fastdeploy"):
        store = KVPoolStore(namespace="m", mode="local", worker=str(tmp_path / "no-worker.sock"), timeout_s=1.0)
        lay = Layout(store, blocks=3, stride=BF16_STRIDE)
        lay.fill_write()
        keys = fastdeploy_keys(["d0", "d1", "d2"])
        _assert_down_behaviour(store, lay, keys)
        _assert_down_behaviour(store, lay, keys)
        store.close()
    outage = [r for r in caplog.records if "kvpool unavailable" in r.getMessage()]
    assert len(outage) == 1 and "no-worker.sock" in outage[0].getMessage()


def test_worker_killed_mid_run_is_a_miss_not_an_exception(spawn: Callable[..., Any]) -> None:
    worker = spawn()
    store = KVPoolStore(namespace="m", mode="local", worker=worker.unix_path, timeout_s=2.0)
    try:
        lay = Layout(store, blocks=4, stride=BF16_STRIDE)
        lay.fill_write()
        keys = fastdeploy_keys([f"k{i}" for i in range(4)])
        assert store.batch_set(**lay.args(keys, "write")) == [0] * 8
        assert store.query(keys[0], keys[1]) == 4
        assert store.batch_get(**lay.args(keys, "read")) == [BF16_STRIDE] * 8
        lay.assert_read_equals_write()
        worker.kill()
        lay.read.array[:] = 0
        _assert_down_behaviour(store, lay, keys)
        assert not lay.read.array.any()  # nothing was written into the engine's buffer
    finally:
        store.close()


def test_tcp_worker_round_trip(spawn: Callable[..., Any]) -> None:
    worker = spawn()
    store = KVPoolStore(namespace="m", mode="local", worker=worker.address)
    try:
        lay = Layout(store, blocks=3, stride=BF16_STRIDE)
        lay.fill_write()
        keys = fastdeploy_keys(["t0", "t1", "t2"])
        assert store.batch_set(**lay.args(keys, "write")) == [0] * 6
        assert store.batch_get(**lay.args(keys, "read")) == [BF16_STRIDE] * 6
        lay.assert_read_equals_write()
    finally:
        store.close()


class FlakyClient:
    """An embedded PoolClient that raises PoolUnavailable while `down`, counting the calls that reach it."""

    def __init__(self) -> None:
        self.pool = PoolClient(**SMALL_POOL)
        self.down = False
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.pool, name)

        def call(*args: Any, **kw: Any) -> Any:
            self.calls += 1
            if self.down:
                raise PoolUnavailable("worker 127.0.0.1:7461: [Errno 111] Connection refused")
            return target(*args, **kw)
        return call


def test_outage_backs_off_then_recovers(caplog: pytest.LogCaptureFixture) -> None:
    flaky = FlakyClient()
    store = KVPoolStore(client=flaky, retry_s=0.3)  # type: ignore[arg-type]
    lay = Layout(store, blocks=2, stride=BF16_STRIDE)
    lay.fill_write()
    keys = fastdeploy_keys(["r0", "r1"])
    try:
        with caplog.at_level(logging.INFO, logger="kvpool.backends.fastdeploy"):
            flaky.down = True
            assert store.batch_set(**lay.args(keys, "write")) == [Status.RPC_FAIL] * 4
            reached = flaky.calls
            for _ in range(20):  # within the back-off nothing reaches the pool
                assert store.query(keys[0], keys[1]) == 0
            assert flaky.calls == reached
            flaky.down = False
            time.sleep(0.35)
            assert store.batch_set(**lay.args(keys, "write")) == [0] * 4
            assert store.batch_get(**lay.args(keys, "read")) == [BF16_STRIDE] * 4
        lay.assert_read_equals_write()
        messages = [r.getMessage() for r in caplog.records]
        assert sum("kvpool unavailable" in m for m in messages) == 1
        assert sum("reachable again" in m for m in messages) == 1
    finally:
        flaky.pool.close()


def test_every_pool_error_has_a_status() -> None:
    errors = [c for c in vars(errors_module).values()
              if isinstance(c, type) and issubclass(c, KVPoolError) and c is not KVPoolError]
    assert len(errors) >= 10
    for cls in errors:
        st = status_of(cls("x"))
        assert st < 0, cls
    assert status_of(errors_module.PoolTimeout("t")) == Status.RPC_FAIL
    assert status_of(errors_module.AuthError("a")) == Status.RPC_FAIL
    assert status_of(errors_module.CapacityError("c")) == Status.NO_AVAILABLE_HANDLE
    for cls in (errors_module.InvalidKey, errors_module.BlockTooLarge, errors_module.BufferSizeError):
        assert status_of(cls("v")) == Status.INVALID_PARAMS
    assert status_of(errors_module.ProtocolError("p")) == Status.INTERNAL_ERROR
    assert {st for _, st in STATUS_OF_ERROR} <= set(Status)


FAKE_BASE = '''
from abc import ABC, abstractmethod

class KVCacheStorage(ABC):
    """The abstract methods of fastdeploy/cache_manager/transfer_factory/kvcache_storage.py."""
    @abstractmethod
    def get(self, key, target_location=None, target_size=None): ...
    @abstractmethod
    def batch_get(self, keys, target_locations=None, target_sizes=None): ...
    @abstractmethod
    def set(self, key, target_location=None, target_size=None): ...
    @abstractmethod
    def batch_set(self, keys, target_locations=None, target_sizes=None): ...
    @abstractmethod
    def exists(self, keys): ...
    @abstractmethod
    def clear(self): ...
    @abstractmethod
    def query(self): ...
'''


def test_subclasses_fastdeploy_base_class_when_fastdeploy_is_importable(tmp_path: Any) -> None:
    pkg = tmp_path / "fastdeploy" / "cache_manager" / "transfer_factory"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "fastdeploy", tmp_path / "fastdeploy" / "cache_manager", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "kvcache_storage.py").write_text(FAKE_BASE)
    script = textwrap.dedent("""
        from fastdeploy.cache_manager.transfer_factory.kvcache_storage import KVCacheStorage
        from kvpool.backends.fastdeploy import KVPoolStore
        s = KVPoolStore(namespace="m", tp_rank=0, dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False)
        assert isinstance(s, KVCacheStorage)
        s.close()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_keys_and_pointers_of_the_wrong_type_are_per_item_errors(store: KVPoolStore) -> None:
    """The store always has a namespace: a key that is not a str has no name in it (a bytes key would
    escape it), and a pointer or size that is not an integer names no memory: INVALID_PARAMS, never a
    TypeError into the engine."""
    lay = Layout(store, blocks=2, stride=BF16_STRIDE)
    lay.fill_write()
    bad = Status.INVALID_PARAMS
    keys: list[Any] = ["prefix_ok_0_key", 7, b"prefix_raw_0_key", None]
    assert store.batch_set(keys=keys, target_locations=[lay.write.ptr] * 4, target_sizes=[BF16_STRIDE] * 4) == \
        [0, bad, bad, bad]
    assert store.batch_get(keys=keys, target_locations=[lay.read.ptr] * 4, target_sizes=[BF16_STRIDE] * 4) == \
        [BF16_STRIDE, bad, bad, bad]
    assert store.batch_set(keys=["prefix_p_0_key", "prefix_q_0_key"], target_locations=[None, lay.write.ptr],
                           target_sizes=[BF16_STRIDE, "many"]) == [bad, bad]
