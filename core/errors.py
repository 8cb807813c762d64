"""The one error hierarchy of kvpool.

Every error a caller can see derives from `KVPoolError`; messages name the bad value and the limit, and
the values travel as attributes too (`key`, `size`, `limit`), as nats.py's errors carry theirs.
Third-party exceptions (lmdb, sockets, nats) are translated at the boundary that meets them.
"""
from __future__ import annotations

__all__ = ["KVPoolError", "InvalidKey", "InvalidArgument", "BlockTooLarge", "BufferSizeError", "CapacityError",
    "PoolClosed", "PoolUnavailable", "PoolTimeout", "Abandoned", "PartialFailure", "PartialPut", "AuthError",
    "NamespaceError", "QuotaExceeded", "ProtocolError",
    "CorruptBlock", "ConfigError", "StorageError", "ListenError", "BenchError"]


class KVPoolError(Exception):
    """Root of every kvpool error. `key`, `size` and `limit` are set where the error concerns one block,
    one byte count or one bound (None otherwise); `str(error)` says the same in words."""

    def __init__(self, message: str = "", *, key: bytes | str | None = None, size: int | None = None,
                 limit: int | float | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.size = size
        self.limit = limit


class InvalidKey(KVPoolError, ValueError):
    """A key is empty, too long, or of the wrong type."""


class InvalidArgument(KVPoolError, ValueError):
    """An argument other than a key is invalid: lists of different lengths, a size or count out of range."""


class BlockTooLarge(KVPoolError, ValueError):
    """A block is larger than a tier (or the wire) accepts."""


class BufferSizeError(KVPoolError, ValueError):
    """A destination buffer does not match the stored block's size."""


class CapacityError(KVPoolError):
    """No room could be made: every candidate block is leased or pinned, or the store is full."""


class PoolClosed(KVPoolError):
    """The cache or client was used after close()."""


class PoolUnavailable(KVPoolError, ConnectionError):
    """The pool (a worker, the cluster) cannot be reached."""


class PoolTimeout(PoolUnavailable, TimeoutError):
    """An operation did not finish within its bound."""


class Abandoned(PoolUnavailable):
    """The connection was given up on by another call that ran past its deadline on it (`Connection.abort`):
    nothing was sent on it for this call. A call that meets it may try a fresh connection."""


class PartialFailure(PoolUnavailable):
    """A cluster call that some live workers did not answer in time while others did: not an outage of
    the pool. `failed`: the indices, in the batch, of the items not done (a remove's keys no owner
    answered for; none for a clear, whose message names the workers); `result`: what the call returns,
    for the other items (None where it returns nothing)."""

    def __init__(self, message: str = "", *, failed: tuple[int, ...] | list[int] = (), result: object = None) -> None:
        super().__init__(message)
        self.failed = list(failed)
        self.result = result


class PartialPut(PartialFailure):
    """A cluster put some of whose blocks no live owner stored (an owner did not answer in time); the
    others were stored. `failed`: the indices, in the batch, of those not stored."""


class AuthError(KVPoolError, PermissionError):
    """A connection failed to authenticate."""


class NamespaceError(AuthError):
    """A tenant's connection named a key (or a clear prefix) outside its namespace `<tenant>/`; nothing
    of the request was done."""


class QuotaExceeded(CapacityError):
    """A tenant's put would take its bytes stored past its quota (`limit`); the block was not stored."""


class ProtocolError(KVPoolError):
    """A malformed or truncated frame, or a peer that does not speak the protocol."""


class CorruptBlock(KVPoolError):
    """A block's bytes disagree with its checksum (in transit or at rest). The block is never returned;
    where the pool can, it drops the copy and reports a miss instead of raising."""


class ConfigError(KVPoolError, ValueError):
    """A configuration value is invalid."""


class StorageError(KVPoolError, OSError):
    """The SSD tier (LMDB) cannot be opened, read or written: a missing folder, a full map, an I/O error."""

    stored: list[bool] | None = None
    """For a batch of blocks committed but not durable (a full disk kept older SSD copies): whether each
    was stored (False: a version as new or newer was held); None otherwise."""


class ListenError(KVPoolError, OSError):
    """A worker cannot listen: its TCP port (or metrics port) is in use or not allowed, or its Unix socket
    cannot be created."""


class BenchError(KVPoolError, RuntimeError):
    """A benchmark could not measure: a peer, baseline or engine process it drives failed or did not
    start, or bytes read back differ from those written."""
