"""The copy kernels (kvpool.core.fastcopy): the C extension and the Python fallback give the same bytes
and the same checksum as a slice assignment and xxhash, at every size and alignment the hot paths see."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import xxhash

from kvpool.core import fastcopy
from kvpool.core.errors import InvalidArgument

IMPLS = {"python": (fastcopy._copy_hash, fastcopy._copy)}
if fastcopy._native is not None:
    IMPLS["native"] = (fastcopy._native.copy_hash, fastcopy._native.copy)

SIZES = [0, 1, 15, 64, 4095, 8191, 8192, 8193, 16384 + 1, 65536 + 13, 3 * 16384, 1 << 20, (1 << 20) + 7]


def test_the_extension_is_built_here() -> None:
    """CI installs with a C compiler: the same-node paths run the native kernels there."""
    assert fastcopy._native is not None and fastcopy.copy_hash is fastcopy._native.copy_hash
    assert fastcopy.SIMD in ("avx2", "base")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("skew", [0, 3, 16])
def test_copy_hash_writes_the_source_and_returns_its_xxh3(impl: str, size: int, skew: int) -> None:
    copy_hash, copy = IMPLS[impl]
    src = os.urandom(size)
    with mmap.mmap(-1, size + 64) as arena:  # a shared mapping, as the arena is; a destination off alignment
        dst = memoryview(arena)[skew:skew + size]
        try:
            assert copy_hash(dst, src) == xxhash.xxh3_64_intdigest(src)
            assert bytes(dst) == src
            assert arena[:skew] == b"\0" * skew and arena[skew + size:] == b"\0" * (64 - skew)  # nothing outside
            arena[:] = b"\0" * len(arena)
            copy(dst, memoryview(src))
            assert bytes(dst) == src
        finally:
            dst.release()


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_hash_at_every_end_of_xxh3s_last_block(impl: str) -> None:
    """XXH3 hashes long input in blocks of 1024 bytes, then the last block's 64-byte stripes, then a last
    stripe that overlaps them: the one-pass AVX2 kernel takes each case apart (the tail it writes
    again), so every length from one block boundary to the next, at both alignments it takes."""
    copy_hash, _ = IMPLS[impl]
    rng = np.random.default_rng(7)
    for n in range(9 * 1024 - 70, 10 * 1024 + 70):
        src = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        with mmap.mmap(-1, n + 64) as arena:
            for skew in (0, 16):
                dst = memoryview(arena)[skew:skew + n]
                try:
                    assert copy_hash(dst, src) == xxhash.xxh3_64_intdigest(src), n
                    assert bytes(dst) == src and arena[skew + n:] == b"\0" * (64 - skew)
                finally:
                    dst.release()
                arena[:] = b"\0" * len(arena)


@pytest.mark.parametrize("impl", IMPLS)
def test_numpy_buffers_either_way(impl: str) -> None:
    copy_hash, copy = IMPLS[impl]
    src = np.arange(300_000, dtype=np.uint16)
    out = np.zeros_like(src)
    assert copy_hash(out, src) == xxhash.xxh3_64_intdigest(src.tobytes())
    assert np.array_equal(out, src)
    out.fill(0)
    copy(memoryview(out).cast("B"), memoryview(src).cast("B"))
    assert np.array_equal(out, src)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_buffers_raise_and_write_nothing(impl: str) -> None:
    copy_hash, copy = IMPLS[impl]
    dst = bytearray(100)
    with pytest.raises(ValueError):
        copy_hash(dst, b"x" * 99)
    with pytest.raises(ValueError):
        copy(dst, b"x" * 101)
    assert dst == bytearray(100)
    with pytest.raises(TypeError):
        copy_hash(b"\0" * 4, b"abcd")  # a read-only destination
    released = memoryview(bytearray(4))
    released.release()
    with pytest.raises(ValueError):  # a mapping released under the caller (copy_placed relies on it)
        copy_hash(bytearray(4), released)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shift", [-4096, -1, 1, 100_000])
def test_overlapping_buffers_copy_as_memmove(impl: str, shift: int) -> None:
    copy_hash, copy = IMPLS[impl]
    size = 200_000
    for fn in (copy_hash, copy):
        buf = bytearray(os.urandom(size + abs(shift)))
        src_at, dst_at = (0, shift) if shift > 0 else (-shift, 0)
        want = bytes(buf[src_at:src_at + size])
        view = memoryview(buf)
        got = fn(view[dst_at:dst_at + size], view[src_at:src_at + size])
        assert bytes(buf[dst_at:dst_at + size]) == want
        if fn is copy_hash:
            assert got == xxhash.xxh3_64_intdigest(want)


@pytest.mark.parametrize("impl", IMPLS)
def test_hash_at_hashes_each_slot_and_refuses_one_outside(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if impl == "python":
        monkeypatch.setattr(fastcopy, "_native", None)
    buf = np.frombuffer(os.urandom((1 << 20) + 100), dtype=np.uint8)
    offsets = np.array([0, 7, 65536, 1 << 20, (1 << 20) + 100], dtype="<i8")
    sizes = np.array([16384, 0, 300_001, 100, 0], dtype="<i8")  # the last two end at the buffer's end
    got = fastcopy.hash_at(buf, offsets, sizes)
    assert got.dtype == np.dtype("<u8")
    assert got.tolist() == [xxhash.xxh3_64_intdigest(buf[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]
    for off, size in [(-1, 10), (0, -1), ((1 << 20) + 1, 100), (1 << 62, 1 << 62)]:
        with pytest.raises(InvalidArgument, match="outside"):
            fastcopy.hash_at(buf, np.array([0, off], "<i8"), np.array([8, size], "<i8"))
    assert fastcopy.hash_at(buf, np.array([], "<i8"), np.array([], "<i8")).size == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_from_copies_each_slot_skips_misses_and_stops_at_a_short_buffer(
        impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if impl == "python":
        monkeypatch.setattr(fastcopy, "_native", None)
    src = np.frombuffer(os.urandom((1 << 20) + 100), dtype=np.uint8)
    offsets = np.array([0, -1, 65536, 7, (1 << 20) + 100], dtype="<i8")  # a miss; the last, empty, at the end
    sizes = np.array([16384, 5, 300_001, 8193, 0], dtype="<i8")
    dsts = [bytearray(16384), bytearray(b"keep"), np.zeros(300_001 + 9, np.uint8), memoryview(bytearray(8193)),
            bytearray(0)]
    assert fastcopy.copy_from(dsts, src, offsets, sizes) == -1
    assert bytes(dsts[0]) == src[:16384].tobytes() and dsts[1] == b"keep"
    assert dsts[2][:300_001].tobytes() == src[65536:65536 + 300_001].tobytes() and not dsts[2][300_001:].any()
    assert bytes(dsts[3]) == src[7:7 + 8193].tobytes()
    # the first destination too short for its block is named; it and those after it are left as they were
    fresh = [bytearray(16384), bytearray(100), bytearray(8193)]
    at = np.array([0, 16384, 7], "<i8")
    assert fastcopy.copy_from(fresh, src, at, np.array([16384, 101, 8193], "<i8")) == 1
    assert bytes(fresh[0]) == src[:16384].tobytes() and not any(fresh[1]) and not any(fresh[2])
    for off, size in [(0, -1), ((1 << 20) + 1, 100), (1 << 62, 1 << 62)]:
        with pytest.raises(InvalidArgument, match="outside"):
            fastcopy.copy_from([bytearray(8), bytearray(1 << 20)], src, np.array([0, off], "<i8"),
                               np.array([8, size], "<i8"))
    with pytest.raises(InvalidArgument, match="as many"):
        fastcopy.copy_from([bytearray(8)], src, np.array([0, 8], "<i8"), np.array([8, 8], "<i8"))
    with pytest.raises((TypeError, BufferError)):  # a destination that cannot be written
        fastcopy.copy_from([b"readonly"], src, np.array([0], "<i8"), np.array([8], "<i8"))
    assert fastcopy.copy_from([], src, np.array([], "<i8"), np.array([], "<i8")) == -1


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_into_copies_each_source_into_its_slot_and_hashes_what_landed(
        impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if impl == "python":
        monkeypatch.setattr(fastcopy, "_native", None)
    dst = np.zeros((1 << 20) + 100, dtype=np.uint8)
    srcs = [os.urandom(16384), np.frombuffer(os.urandom(300_001), np.uint8), memoryview(os.urandom(8193)), b"",
            np.frombuffer(os.urandom(64 * 3), np.uint8).reshape(3, 64)]  # an empty one; a 2-d one
    offsets = np.array([0, 65536, 7 + 16384, (1 << 20) + 100, 400_000], dtype="<i8")  # the empty one at the end
    got = fastcopy.copy_into(dst, offsets, srcs)
    assert got.dtype == np.dtype("<u8")
    flat = [bytes(memoryview(s).cast("B")) for s in srcs]
    assert got.tolist() == [xxhash.xxh3_64_intdigest(b) for b in flat]
    for off, b in zip(offsets.tolist(), flat):
        assert dst[off:off + len(b)].tobytes() == b
    assert int(dst.sum()) == sum(sum(b) for b in flat)  # nothing written elsewhere
    # a slot outside the destination stops the copies there: those before it landed, it and the rest not
    dst[:] = 0
    for off in (-1, (1 << 20) + 1, 1 << 62):
        with pytest.raises(InvalidArgument, match="outside"):
            fastcopy.copy_into(dst, np.array([0, off, 16384], "<i8"), [b"a" * 8, b"b" * 100, b"c" * 8])
        assert dst[:8].tobytes() == b"a" * 8 and not dst[8:].any()
    with pytest.raises(InvalidArgument, match="as many"):
        fastcopy.copy_into(dst, np.array([0, 8], "<i8"), [b"x"])
    with pytest.raises((TypeError, BufferError)):  # a destination that cannot be written
        fastcopy.copy_into(b"readonly", np.array([0], "<i8"), [b"x"])
    assert fastcopy.copy_into(dst, np.array([], "<i8"), []).size == 0


def test_writable_all_says_whether_copy_from_can_write_each_buffer_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writable C-contiguous buffers of any dtype and shape, yes; read-only, strided or not buffers at all,
    no (the caller makes flat byte views of those); without the extension, never (the same views)."""
    frozen = np.zeros(8, np.uint8)
    frozen.flags.writeable = False
    yes = [np.zeros(8, np.uint8), np.zeros((2, 3), np.float32), bytearray(3), memoryview(bytearray(4)), bytearray(0),
           mmap.mmap(-1, 4096)]
    assert fastcopy.writable_all(yes) and fastcopy.writable_all([])
    for bad in (b"bytes", frozen, np.zeros(8, np.uint8)[::2], memoryview(b"ro"), "text", None, 3):
        assert not fastcopy.writable_all([*yes, bad]), bad
    with pytest.raises(TypeError):
        fastcopy.writable_all(5)  # not a sequence
    monkeypatch.setattr(fastcopy, "_native", None)
    assert not fastcopy.writable_all(yes)
