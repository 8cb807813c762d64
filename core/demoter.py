"""The background demoter: one thread per cache that keeps DRAM under its high watermark.

Woken when a commit leaves DRAM above the high watermark, it demotes the first blocks to go (least
recently used, by default) to SSD in batches of at most `DEMOTE_BATCH_BYTES`, each written in one
transaction outside the cache's lock while the blocks are leased, then drops them from DRAM, until
DRAM is under the low watermark. Without an SSD tier the blocks are simply dropped. It also deletes
outdated SSD copies, retrying after a full disk refused them.
"""
from __future__ import annotations

import threading

from .tier_moves import TierMoves
from .tier_stack import TierStack

__all__ = ["Demoter", "DEMOTE_BATCH_BYTES"]

DEMOTE_BATCH_BYTES = 64 << 20
"""DRAM slot bytes one demotion batch frees at most (one LMDB transaction)."""


class Demoter:
    """The demotion thread of `stack`, moving blocks through `moves`. It stops when the stack is
    closed (the cache sets `closed` and notifies `demote_due`); `join` waits for that."""

    def __init__(self, stack: TierStack, moves: TierMoves) -> None:
        self._stack = stack
        self._moves = moves
        self._thread = threading.Thread(target=self._run, name="kvpool-demoter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def restart(self) -> None:
        """In a forked child, whose copy of the thread never runs: a thread of its own."""
        self._thread = threading.Thread(target=self._run, name="kvpool-demoter", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def is_current(self) -> bool:
        """Whether the caller runs on the demoter's thread."""
        return threading.current_thread() is self._thread

    def _delete_stale(self) -> bool:
        ssd = self._stack.ssd
        return ssd.delete_stale() if ssd is not None else True

    def _run(self) -> None:
        stack, moves = self._stack, self._moves
        dram, arena = stack.dram, stack.dram.arena
        high = stack.config.high_watermark * arena.size
        low = stack.config.low_watermark * arena.size
        stuck = False  # the last pass found nothing evictable: wait for the next commit, not spin
        stale_stuck = False  # the last deletion failed (a full disk): retry after a wake-up, not spin
        while True:
            with stack.lock:
                while not stack.closed and (stale_stuck or stack.ssd is None or not stack.ssd.has_stale) and \
                        (stuck or arena.used_bytes <= high):
                    stack.demote_due.wait()
                    stuck = stale_stuck = False
                if stack.closed:
                    break
                stale_stuck = not self._delete_stale()
                dram.pins.expire()  # expired pins are evictable again before victims are chosen
                victims = dram.lru_victims(arena.used_bytes - low, DEMOTE_BATCH_BYTES)
                stuck = not victims
                moves.begin_write(victims)
            try:
                moves.demote([b for b in victims if not b.on_ssd])
            finally:
                with stack.lock:
                    moves.end_write(victims)
                    for b in victims:
                        if b.live and b.leases == 0 and dram.blocks.get(b.key) is b and not b.pinned:
                            moves.evicted(b)
        with stack.lock:
            self._delete_stale()
