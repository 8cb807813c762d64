"""Byte views of the buffers callers hand us: bytes-likes, numpy arrays and torch tensors.

Everything in the pool moves as flat uint8 memoryviews. Device tensors are staged through host memory
here, in one place, so tiers and transports only ever see host bytes; a batch's CUDA tensors are staged
together, in pinned memory (`cuda_staging`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .cuda_staging import host_buffers, to_devices, to_host
from .errors import BufferSizeError, InvalidArgument, KVPoolError

__all__ = ["readable", "readable_all", "byte_size", "Destination", "destinations", "destination_views",
           "finish_all"]


_readable_views: Callable[[Sequence[Any]], list[memoryview] | None] | None
try:
    from ._native import readable_views as _readable_views
except ImportError:  # no C compiler when it was installed: one view at a time
    _readable_views = None

_FLAT_TYPES = frozenset({np.ndarray, bytearray, memoryview, bytes})
"""Types whose flat uint8 buffers are used as they are (`memoryview(buf)` says whether one is)."""


def _is_torch(buf: Any) -> bool:
    """Whether `buf` is a torch tensor (not any object of torch's: a `torch.Size`, a storage)."""
    if not type(buf).__module__.startswith("torch"):
        return False
    import torch

    return isinstance(buf, torch.Tensor)


def _on_cuda(buf: Any) -> bool:
    """Whether `buf` is a torch tensor on a CUDA device (staged in pinned memory)."""
    return _is_torch(buf) and bool(buf.device.type == "cuda")


def _cuda_tensors(buffers: Sequence[Any]) -> list[Any]:
    """The CUDA tensors among `buffers` (flat byte buffers, the usual batch, are passed over cheaply)."""
    return [b for b in buffers if type(b) not in _FLAT_TYPES and _on_cuda(b)]


def _not_bytes(buf: Any, why: object) -> InvalidArgument:
    return InvalidArgument(f"a block's data must be bytes-like, a numpy array or a torch tensor of plain "
                           f"values, not this {type(buf).__name__} ({why})")


def _flat_bytes(t: Any) -> Any:
    import torch

    # (a conjugate or negative view's bits are made real first: such a view has no bytes of its own to view)
    try:
        return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:  # sparse, nested, meta tensors
        raise _not_bytes(t, e) from e


def _torch_host_bytes(t: Any) -> np.ndarray:
    flat = _flat_bytes(t)
    if flat.device.type == "cuda":
        return to_host([flat])[0]
    if flat.device.type == "meta":  # (a shape without storage: no bytes to copy)
        raise _not_bytes(t, "a meta tensor has no data")
    if flat.device.type != "cpu":
        flat = flat.cpu()
    host: np.ndarray = flat.numpy()
    return host


def readable(buf: Any) -> memoryview:
    """A flat read-only byte view of `buf` (bytes-like, numpy array or torch tensor)."""
    if type(buf) in _FLAT_TYPES:  # the common case first, cheaply: a flat byte buffer as it is
        try:
            mv = memoryview(buf)
        except ValueError as e:  # a numpy dtype no buffer carries (datetime64)
            raise _not_bytes(buf, e) from e
        if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
            return mv
    if _is_torch(buf):
        return _torch_host_bytes(buf).data.cast("B")
    if isinstance(buf, np.ndarray):
        try:
            return np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data
        except (TypeError, ValueError) as e:  # object or datetime arrays: no bytes of plain values
            raise _not_bytes(buf, e) from e
    try:
        mv = memoryview(buf)
    except TypeError:
        raise InvalidArgument(f"a block's data must be bytes-like, a numpy array or a torch tensor, not "
                              f"{type(buf).__name__}") from None
    if mv.format != "B" or mv.ndim != 1 or not mv.c_contiguous:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    return mv


def readable_all(buffers: Sequence[Any]) -> list[memoryview]:
    """`[readable(b) for b in buffers]`, but the batch's CUDA tensors are copied to the host together:
    into one pinned buffer, waited for once (`cuda_staging.to_host`). A batch of flat byte buffers (the
    usual one) is viewed in one C call where the extension was built."""
    if _readable_views is not None and type(buffers) in (list, tuple):
        views = _readable_views(buffers)
        if views is not None:
            return views
    cuda = _cuda_tensors(buffers)
    if not cuda:
        return [readable(b) for b in buffers]
    staged = iter(to_host([_flat_bytes(b) for b in cuda]))
    return [next(staged).data.cast("B") if _on_cuda(b) else readable(b) for b in buffers]


def byte_size(buf: Any) -> int:
    """`readable(buf).nbytes`, without making the view (a device tensor is not copied to the host)."""
    if _is_torch(buf):
        return int(buf.numel()) * int(buf.element_size())
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    return readable(buf).nbytes


class Destination:
    """A writable flat byte view of a caller's buffer; `finish()` publishes what was written.

    CPU buffers are written in place through `view`. For a torch tensor, `tensor` is its flat uint8
    view (for device-to-device copies); a device tensor's `view` is of a host staging tensor (`host`
    where given: pinned memory that `destinations` shares among a batch) that `finish()` moves to the
    device in one copy.
    """

    __slots__ = ("view", "tensor", "_host")

    def __init__(self, buf: Any, host: Any = None) -> None:
        self.tensor: Any = None
        self._host: Any = None
        try:
            self._view_of(buf, host)
        except KVPoolError:
            raise
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:  # no writable plain bytes
            raise InvalidArgument(f"a destination must be a writable buffer, numpy array or torch tensor of plain "
                                  f"values, not this {type(buf).__name__} ({e})") from e

    def _view_of(self, buf: Any, host: Any) -> None:
        if type(buf) in _FLAT_TYPES:  # the common case first, cheaply: a flat writable byte buffer
            mv = memoryview(buf)
            if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous and not mv.readonly:
                self.view = mv
                return
        if _is_torch(buf):
            import torch

            if not buf.is_contiguous():
                raise BufferSizeError("destination tensor is not contiguous; pass a contiguous tensor")
            if buf.device.type == "meta":
                raise InvalidArgument("a destination tensor on the meta device has no data to write")
            self.tensor = buf.reshape(-1).view(torch.uint8)
            if self.tensor.device.type == "cpu":
                self.view = memoryview(self.tensor.numpy())
                return
            n = int(self.tensor.numel())
            if host is None:
                host = host_buffers([n])[0] if _on_cuda(buf) else torch.empty(n, dtype=torch.uint8)
            self._host = host
            self.view = memoryview(host.numpy())
        elif isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous or not buf.flags.writeable:
                raise BufferSizeError("destination array must be C-contiguous and writeable")
            self.view = buf.reshape(-1).view(np.uint8).data
        else:
            mv = memoryview(buf)
            if mv.readonly:
                raise BufferSizeError(f"destination {type(buf).__name__} is read-only")
            if not mv.c_contiguous:
                raise BufferSizeError(f"destination {type(buf).__name__} is not contiguous; pass a contiguous buffer")
            self.view = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    def finish(self, nbytes: int) -> None:
        """Publish the first `nbytes` written into `view` to the caller's buffer."""
        finish_all([self], [nbytes])


def finish_all(dests: Sequence[Destination], sizes: Sequence[int]) -> None:
    """`finish` each destination with the size written into it (-1: nothing; a no-op but for staged
    tensors). The copies to CUDA tensors are queued together and waited for once."""
    to_cuda: list[tuple[Any, Any]] = []
    for size, dest in zip(sizes, dests):
        if dest._host is None or size <= 0:
            continue
        if dest.tensor.device.type == "cuda":
            to_cuda.append((dest.tensor, dest._host[:size]))
        else:
            dest.tensor[:size].copy_(dest._host[:size])
    if to_cuda:
        to_devices(to_cuda)


def destinations(buffers: Sequence[Any]) -> list[Destination]:
    """A `Destination` of each buffer; the CUDA tensors among them are staged in one pinned buffer."""
    cuda = _cuda_tensors(buffers)
    if not cuda:
        return [Destination(b) for b in buffers]
    hosts = iter(host_buffers([byte_size(b) for b in cuda]))
    return [Destination(b, next(hosts)) if _on_cuda(b) else Destination(b) for b in buffers]


def destination_views(buffers: Sequence[Any]) -> tuple[list[memoryview], list[Destination] | None]:
    """Writable flat byte views of a batch's buffers, and the `Destination`s to `finish_all` after
    writing into them: None when every buffer is a flat writable byte buffer already (numpy uint8
    arrays, bytearrays, memoryviews: the usual batch), whose views are made in one pass."""
    if all(type(b) in _FLAT_TYPES for b in buffers):
        views: list[memoryview] | None
        try:
            views = [memoryview(b) for b in buffers]
        except ValueError:  # a numpy dtype no buffer carries (datetime64): `Destination` says so
            views = None
        if views is not None and all(v.format == "B" and v.ndim == 1 and v.c_contiguous and not v.readonly
                                     for v in views):
            return views, None
    dests = destinations(buffers)
    return [d.view for d in dests], dests
