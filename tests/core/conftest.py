"""Fixtures of the core tests: small caches that are always closed."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.core import TieredCache

from corehelp import SMALL


@pytest.fixture
def make_cache() -> Iterator[Callable[..., TieredCache]]:
    """Build TieredCaches over SMALL (overridable); every one is closed at teardown."""
    made: list[TieredCache] = []

    def make(**overrides: Any) -> TieredCache:
        cache = TieredCache(**{**SMALL, **overrides})
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


@pytest.fixture
def ssd_dir(tmp_path: Path) -> str:
    return str(tmp_path / "ssd")
