"""What the reviews of puts on a full disk share (tests/faults/test_review_twelfth.py, _fourteenth.py): an
in-process worker's settings and stop, and a writer whose clock runs ahead of this process's."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.core.errors import StorageError
from kvpool.core.server import Worker
from kvpool.core.versions import CLOCK, COUNTER_BITS

SMALL = {"dram_bytes": 8 << 20, "dram_slab_size": 1 << 20, "prefault": False}
POOL = "pool-token-" + "p" * 32
A_TOKEN = "tenant-a-" + "a" * 32


def stop(w: Worker, timeout: float = 10.0) -> BaseException | None:
    """Stop `w`; what its stop raised, if anything (its cache then closed here, so no arena is left)."""
    try:
        w.stop(timeout=timeout)
    except BaseException as e:
        w.cache.close()
        w.metrics.close()
        return e
    return None


@pytest.fixture(autouse=True)
def clock_put_back() -> Iterator[None]:
    """The clock this process shares with its in-process workers, put back after each test: one test's
    writer ahead (merged into it by a put made above that writer's version) must not push the next's."""
    saved = CLOCK._last
    yield
    CLOCK._last = saved


def held_newer_elsewhere(w: Worker, key: str, data: bytes) -> None:
    """`key` put at `w` by another writer whose clock runs 0.5 s ahead of this process's (which has not seen
    that version: the worker runs in this process, and would have merged it into the shared clock). A
    StorageError (a full disk kept the older SSD copy) is that writer's."""
    saved = CLOCK._last
    try:
        w.cache.batch_put([key], [data], versions=[CLOCK.now() + (500 << COUNTER_BITS)])
    except StorageError:  # (stored, not durable)
        pass
    finally:
        CLOCK._last = saved
