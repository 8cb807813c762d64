"""Review of the fixes 2edbc5a, 0518bca, afdee06, dbfd238, 5eae4a3, c546466 and 951b306 (streams purges,
connection waits and interrupted fan-outs, vLLM saves after a failed load, tiered-cache races): what they
got wrong or left. Each test names the bug it shows."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvpool.core import TieredCache
from kvpool.core.errors import KVPoolError
from kvpool.core.tier_moves import TierMoves

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
from corehelp import SMALL, KiB, close_while_held, payload


# Bug: a read racing close() still raises a raw TypeError ("a bytes-like object is required, not
# 'NoneType'") where the block's checksum is checked on that read (verify_dram_reads, or a block's first
# read after an unchecked commit): TierMoves.verified_many hashes
# stack.dram.arena.buf (None once closed) outside `_closing_met` (tier_moves.py verified_many / acquire_many,
# cache.py _readable and _get_into call `verified` outside it), not PoolClosed.
def test_a_read_checking_its_block_while_close_runs_raises_a_kvpool_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = TieredCache(**SMALL, verify_dram_reads=True)
    data = payload("k", 10 * KiB)
    cache.put("k", data)
    real = TierMoves.verified_many
    entered, go = threading.Event(), threading.Event()

    def verified_many(moves: TierMoves, blocks: Any) -> Any:
        if threading.current_thread().name == "reader" and not entered.is_set():
            entered.set()
            go.wait(10)  # the block is leased; close() runs now
        return real(moves, blocks)

    monkeypatch.setattr(TierMoves, "verified_many", verified_many)
    got = close_while_held(cache, lambda: cache.get("k"), "reader", entered, go)
    assert got in (None, data) or isinstance(got, KVPoolError), f"an untyped error: {got!r}"
