"""Host staging of CUDA tensors: pinned memory, the copies of a batch queued together and waited for once.

The pool moves host bytes, so a CUDA tensor put is first copied to the host and one read into is filled
on the host first. `tensor.cpu()` and a copy from a numpy array use pageable memory, which the driver
copies through a pinned buffer of its own, and wait for each tensor. On an H100 (docs/BENCHMARKS.md,
run AJ), 64 MiB of 1 MiB tensors moved at 9.5 GB/s to the host and 7.6 from it that way, against 48
both ways between the device and pinned memory. Here a batch's tensors share one pinned buffer, their
copies are queued without blocking on each tensor's current stream, and each stream is waited for once.

Pinned buffers come from torch's caching host allocator, which keeps a freed buffer for the next
request of its size (the first costs ~25 ms per 64 MiB, later ones microseconds) and does not reuse a
buffer until the copies queued on it are done. A staged view holds its buffer for as long as it is
referenced. Where no pinned memory can be had, tensors are copied one at a time through pageable
memory, as before.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["is_cuda", "to_host", "host_buffers", "to_devices"]


def is_cuda(t: Any) -> bool:
    """Whether `t` (a torch tensor) lives on a CUDA device."""
    return bool(t.device.type == "cuda")


def _pinned(nbytes: int) -> Any:
    """A pinned uint8 host tensor of `nbytes`, or None where pinned memory cannot be had."""
    import torch

    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:  # out of pinned memory, or a driver that refuses: pageable copies instead
        return None


def _split(host: Any, sizes: Sequence[int]) -> list[Any]:
    """Consecutive slices of `host` (a flat tensor) of `sizes` elements."""
    out: list[Any] = []
    at = 0
    for n in sizes:
        out.append(host[at:at + n])
        at += n
    return out


def _wait(tensors: Sequence[Any]) -> None:
    """Wait for the work queued on the current stream of each CUDA device among `tensors`."""
    import torch

    for device in {t.device for t in tensors}:
        torch.cuda.current_stream(device).synchronize()


def to_host(flats: Sequence[Any]) -> list[np.ndarray]:
    """Host copies of flat uint8 CUDA tensors, as numpy arrays: slices of one pinned buffer, filled by
    copies queued together and waited for once."""
    sizes = [int(t.numel()) for t in flats]
    host = _pinned(sum(sizes))
    if host is None:
        return [t.cpu().numpy() for t in flats]
    parts = _split(host, sizes)
    for part, t in zip(parts, flats):
        part.copy_(t, non_blocking=True)
    _wait(flats)
    return [part.numpy() for part in parts]


def host_buffers(sizes: Sequence[int]) -> list[Any]:
    """Writable uint8 host tensors of `sizes` bytes to fill before `to_devices`: slices of one pinned
    buffer (pageable tensors where no pinned memory can be had)."""
    import torch

    host = _pinned(sum(sizes))
    if host is None:
        return [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return _split(host, sizes)


def to_devices(copies: Sequence[tuple[Any, Any]]) -> None:
    """Copy each (flat uint8 CUDA tensor, host tensor no longer than it) pair's host bytes into the
    front of its device tensor, the copies queued together and waited for once."""
    for t, host in copies:
        t[:host.numel()].copy_(host, non_blocking=True)
    _wait([t for t, _ in copies])
