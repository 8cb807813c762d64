"""Byte views of the buffers callers hand us: bytes-likes, numpy arrays and torch tensors.

Everything in the pool moves as flat uint8 memoryviews. CUDA tensors are staged through host memory
here, in one place, so tiers and transports only ever see host bytes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import BufferSizeError, InvalidArgument

__all__ = ["readable", "byte_size", "Destination", "destination_views", "finish_all"]


_FLAT_TYPES = frozenset({np.ndarray, bytearray, memoryview, bytes})
"""Types whose flat uint8 buffers are used as they are (`memoryview(buf)` says whether one is)."""


def _torch_host_bytes(t: Any) -> np.ndarray:
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    host: np.ndarray = flat.numpy()
    return host


def readable(buf: Any) -> memoryview:
    """A flat read-only byte view of `buf` (bytes-like, numpy array or torch tensor)."""
    if type(buf) in _FLAT_TYPES:  # the common case first, cheaply: a flat byte buffer as it is
        mv = memoryview(buf)
        if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
            return mv
    if type(buf).__module__.startswith("torch"):
        return _torch_host_bytes(buf).data.cast("B")
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data
    try:
        mv = memoryview(buf)
    except TypeError:
        raise InvalidArgument(f"a block's data must be bytes-like, a numpy array or a torch tensor, not "
                              f"{type(buf).__name__}") from None
    if mv.format != "B" or mv.ndim != 1 or not mv.c_contiguous:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    return mv


def byte_size(buf: Any) -> int:
    """`readable(buf).nbytes`, without making the view (a device tensor is not copied to the host)."""
    if type(buf).__module__.startswith("torch"):
        return int(buf.numel()) * int(buf.element_size())
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    return readable(buf).nbytes


class Destination:
    """A writable flat byte view of a caller's buffer; `finish()` publishes what was written.

    CPU buffers are written in place through `view`. For a torch tensor, `tensor` is its flat uint8
    view (for device-to-device copies); a CUDA tensor's `view` is a host staging array that
    `finish()` moves to the device in one copy.
    """

    __slots__ = ("view", "tensor", "_staged")

    def __init__(self, buf: Any) -> None:
        self.tensor: Any = None
        self._staged = False
        if type(buf) in _FLAT_TYPES:  # the common case first, cheaply: a flat writable byte buffer
            mv = memoryview(buf)
            if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous and not mv.readonly:
                self.view = mv
                return
        if type(buf).__module__.startswith("torch"):
            import torch

            if not buf.is_contiguous():
                raise BufferSizeError("destination tensor is not contiguous; pass a contiguous tensor")
            self.tensor = buf.reshape(-1).view(torch.uint8)
            if self.tensor.device.type == "cpu":
                self.view = memoryview(self.tensor.numpy())
            else:
                self._staged = True
                self.view = np.empty(self.tensor.numel(), dtype=np.uint8).data
        elif isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous or not buf.flags.writeable:
                raise BufferSizeError("destination array must be C-contiguous and writeable")
            self.view = buf.reshape(-1).view(np.uint8).data
        else:
            mv = memoryview(buf)
            if mv.readonly:
                raise BufferSizeError(f"destination {type(buf).__name__} is read-only")
            if not mv.c_contiguous and (mv.format != "B" or mv.ndim != 1):
                raise BufferSizeError(f"destination {type(buf).__name__} is not contiguous; pass a contiguous buffer")
            self.view = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    def finish(self, nbytes: int) -> None:
        """Publish the first `nbytes` written into `view` to the caller's buffer."""
        if self._staged and nbytes > 0:
            import torch

            host = torch.frombuffer(self.view[:nbytes], dtype=torch.uint8)
            self.tensor[:nbytes].copy_(host)


def finish_all(dests: Sequence[Destination], sizes: Sequence[int]) -> None:
    """`finish` each destination with the size written into it (-1: nothing; a no-op but for staged tensors)."""
    for size, dest in zip(sizes, dests):
        if dest._staged:
            dest.finish(size)


def destination_views(buffers: Sequence[Any]) -> tuple[list[memoryview], list[Destination] | None]:
    """Writable flat byte views of a batch's buffers, and the `Destination`s to `finish_all` after
    writing into them: None when every buffer is a flat writable byte buffer already (numpy uint8
    arrays, bytearrays, memoryviews: the usual batch), whose views are made in one pass."""
    if all(type(b) in _FLAT_TYPES for b in buffers):
        views: list[memoryview] = [memoryview(b) for b in buffers]
        if all(v.format == "B" and v.ndim == 1 and v.c_contiguous and not v.readonly for v in views):
            return views, None
    dests = [Destination(b) for b in buffers]
    return [d.view for d in dests], dests
