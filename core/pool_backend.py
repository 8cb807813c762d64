"""`PoolBackend`: the one interface under `PoolClient`, as httpx hands every request to its transport.

An embedded cache (`EmbeddedBackend`), one worker over shared memory or TCP (`ShmTransport`,
`TcpTransport`), a cluster (`ClusterBackend`) and a dict for tests (`MemoryBackend`) implement it.
PoolClient has validated the arguments before a backend sees them: keys are canonical `bytes`, the
lists have equal lengths. Buffers arrive as the caller passed them (bytes-likes, numpy arrays, torch
tensors): only the backend knows whether it keeps a device tensor where it is (the embedded device
tier) or needs host bytes (`buffers.readable` / `buffers.Destination`) for the wire.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from .records import PoolStats, WorkerInfo

__all__ = ["MembersPredicate", "PoolBackend", "leases_by_copy", "copies"]

MembersPredicate = Callable[[dict[str, WorkerInfo]], bool]


class PoolBackend(Protocol):
    """Blocks by key, in batches; a miss is -1 / False / None, never an exception."""

    @property
    def max_block(self) -> int:
        """Largest block accepted, in bytes."""

    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float = 0.0) -> None:
        """Store each buffer under its key; `pin_s` > 0 pins the blocks for that many seconds from
        before they become visible. Raises (BlockTooLarge, CapacityError, PoolUnavailable, ...) when
        a block is not stored."""

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[int]:
        """Copy each block into its buffer: its size, or -1 on a miss."""

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of the chain are present."""

    def batch_remove(self, keys: Sequence[bytes]) -> list[bool]:
        """True where a block was present (on any replica)."""

    def batch_pin(self, keys: Sequence[bytes], pin_s: float) -> None:
        """Pin for `pin_s` seconds from now (renewing); `pin_s` <= 0 unpins."""

    def batch_lease(self, keys: Sequence[bytes]) -> AbstractContextManager[list[memoryview | None]]:
        """Read-only views valid inside the `with` (None per miss): zero copy where the pool shares
        memory with this process, a copy otherwise."""

    def clear(self, prefix: bytes | None = None) -> None: ...

    def stats(self) -> PoolStats: ...

    def members(self) -> dict[str, WorkerInfo]:
        """The live workers by id (embedded: none; one worker: that one)."""

    def wait_for_members(self, predicate: MembersPredicate, timeout_s: float) -> bool:
        """Whether `predicate(members())` holds within `timeout_s` seconds."""

    def close(self) -> None: ...


@contextmanager
def leases_by_copy(backend: PoolBackend, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
    """`batch_lease` for a backend that shares no memory with this process (`copies`)."""
    yield copies(keys, backend.max_block, backend.batch_get_into)


def copies(keys: Sequence[bytes], max_block: int,
           get_into: Callable[[Sequence[bytes], Sequence[Any]], list[int]]) -> list[memoryview | None]:
    """A copy of each block (None per miss), received by `get_into` one at a time into one scratch buffer
    of `max_block` bytes (its size is not known before it arrives), then copied out at its own size."""
    out: list[memoryview | None] = []
    scratch = memoryview(bytearray(max_block)) if keys else memoryview(b"")
    for key in keys:
        n = get_into([key], [scratch])[0]
        out.append(None if n < 0 else memoryview(scratch[:n].tobytes()))
    return out
