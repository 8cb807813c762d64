"""kvpool core: the tiered block cache (device, shared-memory DRAM, LMDB SSD) its client, keys and errors.

Also what the faces (kvpool.backends, kvpool.streams) build on, so that they need no module of core by
name: the client's configuration, keys, block checksums, buffer views, the asyncio loop thread and
NATS helpers, and the command-line hook type (`registry`). Their bench suites use `kvpool.core.bench`.
"""
from .aio import LoopThread, nats_connect, nats_denied, nats_failure
from .async_client import AsyncPoolClient
from .background import Alarm
from .blocks import checksum
from .buffers import readable, readable_all
from .cache import TieredCache
from .client import ClientConfig, PoolClient
from .config import CacheConfig, WorkerConfig
from .config import load as load_config
from .errors import (
    AuthError,
    BenchError,
    BlockTooLarge,
    BufferSizeError,
    CapacityError,
    ConfigError,
    CorruptBlock,
    InvalidArgument,
    InvalidKey,
    KVPoolError,
    NamespaceError,
    PartialFailure,
    PartialPut,
    PoolClosed,
    PoolTimeout,
    PoolUnavailable,
    ProtocolError,
    QuotaExceeded,
    StorageError,
)
from .keys import MAX_KEY_BYTES, Key, block_keys, key_bytes, keys_bytes
from .nats_creds import NatsCreds, Role, find_creds, redacted_url
from .records import PoolStats
from .registry import AddParser, Subparsers
from .shm_read import get_placed, put_placed, read_placed
from .shm_refs import Place
from .shm_stage import Stagers
from .versions import CLOCK_SKEW_MS

__all__ = [
    "TieredCache", "PoolClient", "AsyncPoolClient", "CacheConfig", "block_keys", "MAX_KEY_BYTES",
    "KVPoolError", "InvalidKey", "BlockTooLarge", "BufferSizeError", "CapacityError", "ConfigError",
    "PoolClosed", "PoolTimeout", "PoolUnavailable", "PartialFailure", "PartialPut", "AuthError", "ProtocolError",
    "InvalidArgument", "CorruptBlock", "StorageError", "BenchError",
    "NamespaceError", "QuotaExceeded", "WorkerConfig", "PoolStats",
    # what the faces build on
    "ClientConfig", "load_config", "Key", "key_bytes", "checksum", "readable", "readable_all", "LoopThread",
    "nats_connect", "nats_failure", "nats_denied", "NatsCreds", "Role", "find_creds", "redacted_url", "AddParser",
    "Subparsers", "Place", "put_placed", "read_placed", "get_placed", "Stagers", "Alarm", "keys_bytes", "CLOCK_SKEW_MS",
]
