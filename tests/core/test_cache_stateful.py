"""A hypothesis state machine drives TieredCache against a dict model.

With an SSD tier big enough for everything, nothing may be lost: every hit and every lookup must
agree with the model exactly. Without one, evicted blocks may be misses, but a hit is always the
bytes last put, and a block once missed never comes back. After every step the cache's own
bookkeeping (arena bytes, tier indexes, the LMDB contents) must agree with itself (`check()`) and
the model.
"""
from __future__ import annotations

import shutil
import tempfile

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core import BufferSizeError, TieredCache
from kvpool.core.blocks import checksum

from corehelp import KiB, MiB, payload

ALL_KEYS = [f"k{i}" for i in range(8)]
KEYS = st.sampled_from(ALL_KEYS)
SIZES = st.one_of(st.integers(0, 300 * KiB),
                  st.sampled_from([0, 1, 255, 256, 257, 4 * KiB, 64 * KiB, 128 * KiB + 1, 300 * KiB]))
SEEDS = st.integers(0, 1 << 16)

# three 512 KiB slabs: a few blocks, or a few size classes, already force eviction
ARENA = dict(dram_bytes=3 * 512 * KiB, dram_slab_size=512 * KiB, prefault=False)


class CacheMachine(RuleBasedStateMachine):
    with_ssd = True

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvpool-stateful-")
        self.cache = self._open()
        self.model: dict[str, bytes] = {}

    def _open(self) -> TieredCache:
        ssd = dict(ssd_path=self.dir, ssd_sync=False, ssd_map_size=256 * MiB) if self.with_ssd else {}
        return TieredCache(**ARENA, **ssd)

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ----- checking a read against the model ---------------------------------------------------

    def _check_hit(self, key: str, got: bytes | None) -> None:
        if key not in self.model:
            assert got is None, f"{key} was never put (or was removed) but reads {len(got or b'')} bytes"
        elif got is None:
            assert not self.with_ssd, f"{key} was lost although the SSD tier has room"
            del self.model[key]  # evicted for good: it must never come back
        else:
            assert got == self.model[key], f"{key}: wrong bytes"

    # ----- rules ---------------------------------------------------------------------------------

    @rule(key=KEYS, size=SIZES, seed=SEEDS)
    def put(self, key: str, size: int, seed: int) -> None:
        data = payload(f"{key}/{seed}", size)
        self.cache.put(key, data)
        self.model[key] = data

    @rule(items=st.lists(st.tuples(KEYS, SIZES, SEEDS), min_size=1, max_size=6, unique_by=lambda t: t[0]),
          as_tensor=st.booleans())
    def batch_put(self, items: list[tuple[str, int, int]], as_tensor: bool) -> None:
        datas = [payload(f"{k}/{seed}", size) for k, size, seed in items]
        bufs = [torch.frombuffer(bytearray(d), dtype=torch.uint8) if as_tensor and d else d for d in datas]
        self.cache.batch_put([k for k, _, _ in items], bufs)
        self.model.update({k: d for (k, _, _), d in zip(items, datas)})

    @rule(items=st.lists(st.tuples(KEYS, SIZES, SEEDS), min_size=1, max_size=6, unique_by=lambda t: t[0]),
          leased=st.booleans())
    def worker_batch(self, items: list[tuple[str, int, int]], leased: bool) -> None:
        """What a worker does for a same-node writer's batch: reserve_many, copy into the slots,
        commit_many (whose bulk path replaces the blocks its keys held), here with a reader holding the
        first key's old block meanwhile, whose bytes must stay as they were until it lets go."""
        cache = self.cache
        keys = [k.encode() for k, _, _ in items]
        datas = [payload(f"{k}/{seed}/w", size) for k, size, seed in items]
        held = cache.acquire(keys[0]) if leased else None
        before = bytes(cache.arena.buf[held.offset:held.offset + held.size]) if held is not None else None
        try:
            offsets = cache.reserve_many([len(d) for d in datas])
            if None in offsets:  # no room (the arena is small, and a lease may pin a slab): give the rest back
                for off in offsets:
                    if off is not None:
                        cache.abort(off)
                return
            slots = [off for off in offsets if off is not None]
            for off, d in zip(slots, datas):
                cache.arena.buf[off:off + len(d)] = np.frombuffer(d, dtype=np.uint8)
            assert cache.commit_many(keys, slots, [len(d) for d in datas], [checksum(d) for d in datas]) == \
                [True] * len(keys)
            self.model.update({k: d for (k, _, _), d in zip(items, datas)})
            if held is not None:
                assert bytes(cache.arena.buf[held.offset:held.offset + held.size]) == before
        finally:
            if held is not None:
                cache.release(held)

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        self._check_hit(key, self.cache.get(key))

    @rule(key=KEYS, extra=st.integers(0, 100), kind=st.sampled_from(["bytearray", "numpy", "torch"]))
    def get_into(self, key: str, extra: int, kind: str) -> None:
        n = len(self.model.get(key, b"")) + extra
        buf: bytearray | np.ndarray | torch.Tensor
        buf = {"bytearray": lambda: bytearray(b"\xee" * n), "numpy": lambda: np.full(n, 0xEE, np.uint8),
               "torch": lambda: torch.full((n,), 0xEE, dtype=torch.uint8)}[kind]()
        size = self.cache.get_into(key, buf)
        raw = bytes(memoryview(buf.numpy() if isinstance(buf, torch.Tensor) else buf))
        if size < 0:
            assert raw == b"\xee" * n  # a miss leaves the buffer alone
            self._check_hit(key, None)
        else:
            assert raw[size:] == b"\xee" * (n - size)  # the tail is untouched
            self._check_hit(key, raw[:size])

    @rule(key=KEYS)
    def get_into_too_small(self, key: str) -> None:
        data = self.model.get(key)
        if not data:
            return
        try:
            size = self.cache.get_into(key, bytearray(len(data) - 1))
        except BufferSizeError as e:
            assert str(len(data)) in str(e) and str(len(data) - 1) in str(e)
        else:
            assert size == -1
            self._check_hit(key, None)

    @rule(key=KEYS, other=KEYS, size=SIZES, seed=SEEDS)
    def lease_under_pressure(self, key: str, other: str, size: int, seed: int) -> None:
        with self.cache.lease(key) as view:
            if view is None:
                self._check_hit(key, None)
                return
            leased = self.model.get(key)
            self._check_hit(key, bytes(view))
            data = payload(f"{other}/{seed}", size)
            self.cache.put(other, data)  # may replace the leased block itself, and may evict
            self.model[other] = data
            assert bytes(view) == leased, "a leased view changed under its reader"

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        found = self.cache.remove(key)
        if self.with_ssd:
            assert found == (key in self.model)
        else:
            assert not found or key in self.model
        self.model.pop(key, None)
        assert not self.cache.exists(key)

    @rule(key=KEYS)
    def exists(self, key: str) -> None:
        present = self.cache.exists(key)
        if self.with_ssd:
            assert present == (key in self.model)
        elif not present:
            self.model.pop(key, None)
        else:
            assert key in self.model

    @rule(keys=st.lists(KEYS, max_size=6))
    def prefix_match(self, keys: list[str]) -> None:
        n = self.cache.prefix_match(keys)
        expected = next((i for i, k in enumerate(keys) if k not in self.model), len(keys))
        if self.with_ssd:
            assert n == expected
        else:
            assert n <= expected
        assert self.cache.batch_exists(keys[:n]) == [True] * n

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.model.clear()

    @precondition(lambda self: self.with_ssd)
    @rule()
    def flush(self) -> None:
        self.cache.flush()

    @precondition(lambda self: self.with_ssd)
    @rule()
    def flush_close_reopen(self) -> None:
        self.cache.flush()
        self.cache.close()
        self.cache = self._open()
        s = self.cache.stats()
        assert s.dram_blocks == 0 and s.ssd_blocks == len(self.model)

    # ----- invariants ------------------------------------------------------------------------------

    @invariant()
    def bookkeeping_agrees_with_itself_and_the_model(self) -> None:
        cache = self.cache
        # check() waits for the demoter's SSD writes, then compares the arena, the DRAM index, every
        # DRAM block's bytes, the pins, the SSD index and LMDB's contents with one another.
        assert cache.check() == []
        s = cache.stats()
        assert s.dram_bytes <= s.dram_capacity
        resident = {k for k, here in zip(ALL_KEYS, cache.batch_exists(ALL_KEYS)) if here}
        assert resident <= set(self.model), f"removed or never-put keys are resident: {resident - set(self.model)}"
        assert len(resident) <= s.dram_blocks + s.ssd_blocks
        if self.with_ssd:
            assert resident == set(self.model), f"lost: {set(self.model) - resident}"
            assert s.ssd_blocks <= len(self.model)
        for k in set(self.model) - resident:
            del self.model[k]  # evicted for good: it must never come back


CacheMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class CacheWithoutSsdMachine(CacheMachine):
    with_ssd = False


CacheWithoutSsdMachine.TestCase.settings = CacheMachine.TestCase.settings

TestCacheWithSsd = CacheMachine.TestCase
TestCacheWithoutSsd = CacheWithoutSsdMachine.TestCase
