"""The device tier's logic, on CPU tensors (and on CUDA where there is one)."""
from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from kvpool.core import BufferSizeError, TieredCache
from kvpool.core.cache import BlockRef

from corehelp import KiB, MiB, payload

Make = Callable[..., TieredCache]


def tensor_of(key: str, n: int, device: str = "cpu") -> torch.Tensor:
    return torch.frombuffer(bytearray(payload(key, n)), dtype=torch.uint8).to(device)


def exercise_device_tier(make_cache: Make, device: str) -> None:
    """The device tier's contract, on whichever torch device is given."""
    cache = make_cache(device=device, device_bytes=64 * KiB)
    n = 16 * KiB
    cache.put("a", payload("a", n))  # bytes: no device copy yet
    assert cache.stats().device_blocks == 0
    dest = torch.zeros(n, dtype=torch.uint8, device=device)
    assert cache.get_into("a", dest) == n  # a DRAM hit that promotes into the device tier
    assert dest.cpu().numpy().tobytes() == payload("a", n)
    s = cache.stats()
    assert (s.hits_dram, s.hits_device, s.device_blocks, s.device_bytes) == (1, 0, 1, n)
    dest2 = torch.zeros(n // 2, dtype=torch.bfloat16, device=device)  # any dtype of the same size
    assert cache.get_into("a", dest2) == n
    assert dest2.view(torch.uint8).cpu().numpy().tobytes() == payload("a", n)
    s = cache.stats()
    assert (s.hits_dram, s.hits_device) == (1, 1)
    with pytest.raises(BufferSizeError, match=f"{n} bytes.*{n - 2}"):
        cache.get_into("a", torch.zeros(n - 2, dtype=torch.uint8, device=device))

    # a tensor on the device goes to the device tier when it is put
    cache.put("b", tensor_of("b", n, device))
    assert cache.stats().device_blocks == 2
    assert cache.get_into("b", torch.zeros(n, dtype=torch.uint8, device=device)) == n
    assert cache.stats().hits_device == 2

    # capacity: 64 KiB of device memory holds four 16 KiB blocks; the least recently used goes
    for k in ("c", "d", "e"):
        cache.put(k, tensor_of(k, n, device))
    s = cache.stats()
    assert s.device_evictions == 1 and s.device_blocks == 4 and s.device_bytes == 64 * KiB
    big = tensor_of("big", 80 * KiB, device)  # larger than the whole device tier: never kept there
    cache.put("big", big)
    assert cache.stats().device_bytes <= 64 * KiB
    out = torch.zeros(80 * KiB, dtype=torch.uint8, device=device)
    assert cache.get_into("big", out) == 80 * KiB and torch.equal(out, big)

    # a replaced key never serves the stale device copy
    cache.put("c", payload("c2", n))  # bytes replace a block that has a device copy
    out = torch.zeros(n, dtype=torch.uint8, device=device)
    assert cache.get_into("c", out) == n
    assert out.cpu().numpy().tobytes() == payload("c2", n)
    cache.put("d", tensor_of("d2", n, device))
    assert cache.get_into("d", out) == n and out.cpu().numpy().tobytes() == payload("d2", n)
    assert cache.get("d") == payload("d2", n)

    # removed, expired or cleared blocks are misses on the device too
    cache.remove("e")
    assert cache.get_into("e", out) == -1
    cache.put("t", tensor_of("t", n, device), ttl_s=0.15)
    assert cache.get_into("t", out) == n
    time.sleep(0.25)
    assert cache.get_into("t", out) == -1
    cache.clear()
    assert cache.get_into("b", out) == -1
    assert cache.stats().device_blocks == 0 and cache.stats().device_bytes == 0


def test_device_tier_on_cpu_tensors(make_cache: Make) -> None:
    exercise_device_tier(make_cache, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_device_tier_on_cuda(make_cache: Make, device: str) -> None:
    exercise_device_tier(make_cache, device)


def test_no_device_tier_unless_configured(make_cache: Make) -> None:
    cache = make_cache()
    assert cache.device is None
    cache.put("k", torch.ones(10))
    dest = torch.zeros(10)
    assert cache.get_into("k", dest) == 40 and torch.equal(dest, torch.ones(10))
    assert cache.stats().hits_device == 0 and cache.stats().device_blocks == 0


def test_auto_device_without_cuda(make_cache: Make) -> None:
    cache = make_cache(device="auto")
    assert (cache.device is None) == (not torch.cuda.is_available())


def test_device_copy_of_a_block_evicted_everywhere_is_not_served(make_cache: Make) -> None:
    cache = make_cache(dram_bytes=4 * MiB, dram_slab_size=MiB, device="cpu", device_bytes=MiB)
    cache.put("k", tensor_of("k", 64 * KiB))
    for i in range(100):  # no SSD: the DRAM block is dropped
        cache.put(f"p{i}", payload(f"p{i}", 64 * KiB))
    assert not cache.exists("k")
    assert cache.get_into("k", torch.zeros(64 * KiB, dtype=torch.uint8)) == -1


def test_promotion_from_ssd_refills_the_device_tier(make_cache: Make, ssd_dir: str) -> None:
    cache = make_cache(device="cpu", ssd_path=ssd_dir, ssd_sync=False)
    cache.put("k", tensor_of("k", 32 * KiB))
    cache.flush()
    cache.close()
    cache = make_cache(device="cpu", ssd_path=ssd_dir)
    out = torch.zeros(32 * KiB, dtype=torch.uint8)
    assert cache.get_into("k", out) == 32 * KiB  # SSD -> DRAM -> device
    assert cache.get_into("k", out) == 32 * KiB
    s = cache.stats()
    assert (s.hits_ssd, s.hits_device, s.device_blocks) == (1, 1, 1)
    assert out.numpy().tobytes() == payload("k", 32 * KiB)


def test_a_block_replaced_during_a_read_leaves_no_stale_device_copy(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(device="cpu")
    cache.put("k", payload("old", 4 * KiB))
    release = cache.release
    replaced = []

    def release_then_replace(ref: BlockRef) -> None:
        release(ref)
        if not replaced:  # another thread replaces the block right after the read's lease ends
            replaced.append(True)
            cache.put("k", payload("new", 4 * KiB))

    monkeypatch.setattr(cache, "release", release_then_replace)
    out = torch.zeros(4 * KiB, dtype=torch.uint8)
    assert cache.get_into("k", out) == 4 * KiB
    assert out.numpy().tobytes() == payload("old", 4 * KiB)  # the read saw the old block, whole
    monkeypatch.undo()
    assert cache.get_into("k", out) == 4 * KiB
    assert out.numpy().tobytes() == payload("new", 4 * KiB)
