"""The one error hierarchy of kvpool.

Every error a caller can see derives from `KVPoolError`; messages name the bad value and the limit.
Third-party exceptions (lmdb, sockets, nats) are translated at the boundary that meets them.
"""
from __future__ import annotations


class KVPoolError(Exception):
    """Root of every kvpool error."""


class InvalidKey(KVPoolError, ValueError):
    """A key is empty, too long, or of the wrong type."""


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


class AuthError(KVPoolError, PermissionError):
    """A connection failed to authenticate."""


class ProtocolError(KVPoolError):
    """A malformed, truncated or corrupt frame."""


class ConfigError(KVPoolError, ValueError):
    """A configuration value is invalid."""
