"""kvpool core: the tiered block cache (device, shared-memory DRAM, LMDB SSD) its client, keys and errors."""
from .cache import TieredCache
from .async_client import AsyncPoolClient
from .client import PoolClient
from .config import CacheConfig
from .errors import (AuthError, BlockTooLarge, BufferSizeError, CapacityError, ConfigError, InvalidKey,
                     KVPoolError, PoolClosed, PoolTimeout, PoolUnavailable, ProtocolError)
from .keys import MAX_KEY_BYTES, block_keys

__all__ = [
    "TieredCache", "PoolClient", "AsyncPoolClient", "CacheConfig", "block_keys", "MAX_KEY_BYTES",
    "KVPoolError", "InvalidKey", "BlockTooLarge", "BufferSizeError", "CapacityError", "ConfigError",
    "PoolClosed", "PoolTimeout", "PoolUnavailable", "AuthError", "ProtocolError",
]
