"""PoolClient: the one API that backends, streams and tools use to reach the pool.

Modes (chosen by `ClientConfig.mode`, `KVPOOL_MODE`, a config file or kwargs):
- `embedded` (the default): a TieredCache inside this process; no services.
Sizes are bytes; a miss is `None` from `get` and `-1` from `batch_get_into`, never an exception.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .cache import TieredCache
from .config import CacheConfig, load
from .errors import ConfigError
from .keys import Key


@dataclasses.dataclass
class ClientConfig:
    """How a PoolClient reaches the pool."""

    mode: str = "embedded"
    """embedded: a TieredCache in this process."""


class PoolClient:
    """Put, get and query blocks in the pool, whichever way it is reached.

    `PoolClient()` with nothing configured is an embedded pool. Keyword arguments are options of
    `ClientConfig`, or (embedded mode) of `CacheConfig`.
    """

    def __init__(self, config: ClientConfig | None = None, *, cache: CacheConfig | None = None,
                 **overrides: Any) -> None:
        client_fields = {f.name for f in dataclasses.fields(ClientConfig)}
        own = {k: v for k, v in overrides.items() if k in client_fields}
        rest = {k: v for k, v in overrides.items() if k not in client_fields}
        self.config = config if config is not None else load(ClientConfig, **own)
        if self.config.mode != "embedded":
            raise ConfigError(f"mode {self.config.mode!r} is not one of: embedded")
        self._cache = TieredCache(cache if cache is not None else load(CacheConfig, **rest))

    @property
    def max_block(self) -> int:
        return self._cache.max_block

    def put(self, key: Key, data: Any) -> None:
        self._cache.put(key, data)

    def batch_put(self, keys: Sequence[Key], buffers: Sequence[Any]) -> None:
        self._cache.batch_put(keys, buffers)

    def get(self, key: Key) -> bytes | None:
        return self._cache.get(key)

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        return self._cache.batch_get_into(keys, buffers)

    def exists(self, keys: Sequence[Key]) -> list[bool]:
        return self._cache.batch_exists(keys)

    def prefix_match(self, keys: Sequence[Key]) -> int:
        return self._cache.prefix_match(keys)

    def remove(self, keys: Sequence[Key]) -> list[bool]:
        return self._cache.batch_remove(keys)

    def clear(self) -> None:
        self._cache.clear()

    def stats(self) -> dict[str, int]:
        return self._cache.stats()

    def close(self) -> None:
        self._cache.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
