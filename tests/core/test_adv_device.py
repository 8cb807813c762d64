"""Adversarial checks of the device tier (`core/tiers/device.py`) and of torch tensors as a cache's
sources and destinations, on CPU tensors (a device tier on "cpu", as tests/core/test_device.py runs it).

Each test is a behaviour a user relies on that the current code breaks: a cache may miss but never serve
what it should not, and bad input or an optional tier's trouble is a typed KVPoolError, never a raw
torch error."""
from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from kvpool.core import ConfigError, TieredCache
from kvpool.core.buffers import readable

from corehelp import KiB, payload

Make = Callable[..., TieredCache]


def tensor_of(key: str, n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload(key, n)), dtype=torch.uint8)


def test_a_fenced_cache_serves_no_device_copy(make_cache: Make) -> None:
    """While a cache is fenced (a worker back from an absence that may have missed removals and newer
    puts), every read of a block from before the fence is a miss: `get` says so, but a `get_into` a
    tensor is served the device tier's copy of the very block the fence hides."""
    cache = make_cache(device="cpu", device_bytes=64 * KiB)
    n = 4 * KiB
    cache.put("k", tensor_of("k", n))  # a tensor on the tier's device: a device copy is kept
    assert cache.stats().device_blocks == 1
    cache.replicas.fence(True)
    assert cache.get("k") is None and cache.batch_exists(["k"]) == [False]
    out = torch.zeros(n, dtype=torch.uint8)
    assert cache.get_into("k", out) == -1  # observed: n, the fenced-off block's bytes
    assert cache.stats().hits_device == 0


@pytest.mark.parametrize("view", ["conjugate", "negative"])
def test_a_lazily_conjugated_or_negated_tensor_is_stored_with_a_device_tier(make_cache: Make, view: str) -> None:
    """A conjugate view (`x.conj()`) or a negative view is read as its values (`buffers.readable` resolves
    the bit), with or without a device tier: the batch is stored and the block read back as those values.
    With a device tier the put raised torch's RuntimeError after storing that block, and every block
    after it in the batch was never stored."""
    cache = make_cache(device="cpu", device_bytes=64 * KiB)
    x = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j], dtype=torch.complex64)
    odd = x.conj() if view == "conjugate" else torch._neg_view(torch.tensor([1.5, -2.0, 3.25]))
    assert odd.is_conj() or odd.is_neg()
    want = bytes(readable(odd))
    cache.batch_put(["before", "odd", "after"], [torch.ones(4), odd, torch.ones(4)])
    assert cache.batch_exists(["before", "odd", "after"]) == [True, True, True]
    out = torch.zeros(len(want), dtype=torch.uint8)
    assert cache.get_into("odd", out) == len(want) and bytes(out.numpy()) == want
    assert cache.get("odd") == want
    assert cache.check() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_device_tier_without_cuda_is_a_config_error(make_cache: Make) -> None:
    """`device="cuda"` passes the config's check, but on a machine (or a torch build) without CUDA the
    cache (a worker, an embedded PoolClient) fails to start with torch's bare AssertionError "Torch not
    compiled with CUDA enabled", not a ConfigError naming the setting ("auto" is the way to ask for CUDA
    only where there is one)."""
    with pytest.raises(ConfigError, match="device"):
        make_cache(device="cuda")


def test_a_device_tier_without_torch_installed_is_a_config_error(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch is an optional extra (`kvpool[torch]`). Configuring a device tier where it is not installed
    fails with a bare ModuleNotFoundError out of the cache's constructor, not a ConfigError saying the
    device tier needs torch."""
    monkeypatch.setitem(sys.modules, "torch", None)  # as where torch is not installed: `import torch` raises
    with pytest.raises(ConfigError, match="torch"):
        make_cache(device="cpu")


def test_a_read_is_served_when_its_device_copy_cannot_be_made(
        make_cache: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device tier is an optional cache of copies: when keeping a copy fails (HBM full: torch raises
    OutOfMemoryError allocating it), a `get_into` still returns the block it read, and a put still
    succeeds. Instead the get raised torch's OutOfMemoryError after the bytes had landed, and the put
    raised it after storing the block (a batch's later blocks never stored)."""
    cache = make_cache(device="cpu", device_bytes=64 * KiB)
    n = 4 * KiB
    cache.put("k", payload("k", n))  # bytes: no device copy yet
    device = cache.device
    assert device is not None

    def out_of_memory(key: bytes, t: torch.Tensor) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")

    monkeypatch.setattr(device, "put", out_of_memory)
    out = torch.zeros(n, dtype=torch.uint8)
    assert cache.get_into("k", out) == n and bytes(out.numpy()) == payload("k", n)
    cache.batch_put(["t", "u"], [tensor_of("t", n), tensor_of("u", n)])
    assert cache.get("t") == payload("t", n) and cache.get("u") == payload("u", n)
