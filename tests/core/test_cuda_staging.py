"""CUDA tensors reach the pool through host memory: a batch's tensors are staged in one pinned buffer,
their copies queued together and waited for once (`kvpool.core.cuda_staging`). The bytes are what a
plain `.cpu()` gives, for any dtype, shape or stride, and reads land in the front of each tensor."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvpool.core import PoolClient, buffers, cuda_staging
from kvpool.core.buffers import destinations, finish_all, readable_all
from kvpool.core.procs import WorkerProcess

on_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batch(device: str) -> list[Any]:
    """Tensors of several sizes (one empty), dtypes and strides."""
    g = torch.Generator().manual_seed(7)
    raw = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1, 4096, 0, (64 << 10) + 3)]
    return [t.to(device) for t in raw] + [torch.randn(8, 6, generator=g).to(device).t(),  # not contiguous
                                          torch.arange(10, dtype=torch.int64).to(device)]


def _bytes(t: Any) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def test_a_batch_is_staged_in_one_buffer_in_its_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch logic, on CPU tensors taken for CUDA ones: one host buffer for all of them, one wait,
    each view the bytes of its own tensor, the other buffers' views as `readable` makes them."""
    asked: list[int] = []
    waits: list[int] = []

    def host(n: int) -> Any:
        asked.append(n)
        return torch.full((n,), 0xEE, dtype=torch.uint8)

    monkeypatch.setattr(buffers, "_on_cuda", buffers._is_torch)
    monkeypatch.setattr(cuda_staging, "_pinned", host)
    monkeypatch.setattr(cuda_staging, "_wait", lambda ts: waits.append(len(ts)))
    tensors = _batch("cpu")
    batch: list[Any] = [b"host bytes", *tensors[:3], np.arange(3, dtype=np.uint8), *tensors[3:]]
    views = readable_all(batch)
    assert asked == [sum(len(_bytes(t)) for t in tensors)] and waits == [len(tensors)]
    assert [bytes(v) for v in views] == [b"host bytes", *map(_bytes, tensors[:3]), b"\x00\x01\x02",
                                         *map(_bytes, tensors[3:])]


def test_without_pinned_memory_tensors_are_copied_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "_on_cuda", buffers._is_torch)
    monkeypatch.setattr(cuda_staging, "_pinned", lambda n: None)
    tensors = _batch("cpu")
    assert [bytes(v) for v in readable_all(tensors)] == list(map(_bytes, tensors))


@pytest.mark.gpu
@on_cuda
def test_cuda_tensors_are_read_through_pinned_memory() -> None:
    tensors = _batch("cuda")
    views = readable_all([b"x", *tensors])
    assert [bytes(v) for v in views] == [b"x", *map(_bytes, tensors)]
    staged = torch.from_numpy(np.asarray(views[2]))
    assert staged.is_pinned()


@pytest.mark.gpu
@on_cuda
def test_reads_into_cuda_tensors_land_in_front_and_leave_the_rest() -> None:
    sizes = [4096, 100, 7, 0]
    targets: list[Any] = [torch.full((n,), 0xAA, dtype=torch.uint8, device="cuda") for n in sizes]
    targets.append(torch.zeros(4, 3, dtype=torch.float32, device="cuda"))  # 48 bytes
    dests = destinations([*targets, bytearray(5)])
    wrote = [4096, 60, -1, -1, 48, 5]
    for i, (d, n) in enumerate(zip(dests, wrote)):
        if n > 0:
            d.view[:n] = bytes([i + 1]) * n
    finish_all(dests, wrote)
    assert _bytes(targets[0]) == b"\x01" * 4096
    assert _bytes(targets[1]) == b"\x02" * 60 + b"\xaa" * 40
    assert _bytes(targets[2]) == b"\xaa" * 7
    assert _bytes(targets[4]) == b"\x05" * 48


@pytest.mark.gpu
@on_cuda
@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_cuda_tensors_through_a_worker(spawn: Callable[..., WorkerProcess], path: str) -> None:
    worker = spawn()
    src = [t for t in _batch("cuda") if t.numel()]
    keys = [f"cuda-{i}" for i in range(len(src))]
    dst = [torch.zeros_like(t).contiguous() for t in src]
    with PoolClient(mode="local", worker=worker.unix_path if path == "shm" else worker.address) as pool:
        pool.batch_put(keys, src)
        assert pool.batch_get_into(keys, dst) == [len(_bytes(t)) for t in src]
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
