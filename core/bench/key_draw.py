"""Which key each get-or-create asks for, so that a run's hit rate reaches a target.

Keys are numbered. The key pool is the window of the `pool_size` most recently created numbers.
A draw is either a random number from the window (a hit while the pool still holds that block) or
the next fresh number (always a miss, then created). The chance of drawing from the window is
steered by the shortfall of hits so far, `target x gets - hits`: an integral controller, so window
draws that miss (blocks evicted by a small pool) are made up with more window draws, and the whole
run's hit rate converges to the target instead of settling beside it. (kvtest holds its rate by
resizing the key pool in 5% steps; a fixed window keeps the working set, and so the tier mix, steady.)
"""
from __future__ import annotations

import random

__all__ = ["KeyDraw"]


class KeyDraw:
    GAIN = 0.05
    """Added to the window-draw probability per hit of shortfall: large enough to pull the run
    back within a few draws, small enough that one unlucky draw does not swing it to 0 or 1."""

    def __init__(self, target: float, pool_size: int, rng: random.Random) -> None:
        self.target, self.pool_size, self.rng = target, pool_size, rng
        self.lo = self.hi = 0  # the window: numbers lo..hi-1 were created most recently
        self.gets = self.hits = 0

    @property
    def p_window(self) -> float:
        """The current probability of drawing from the window rather than a fresh key."""
        shortfall = self.target * self.gets - self.hits
        return min(1.0, max(0.0, self.target + self.GAIN * shortfall))

    def draw(self, n: int) -> list[int]:
        """`n` key numbers for one batch; fresh numbers enter the window at once."""
        p = self.p_window
        out = []
        for _ in range(n):
            if self.hi > self.lo and self.rng.random() < p:
                out.append(self.rng.randrange(self.lo, self.hi))
            else:
                out.append(self.hi)
                self.hi += 1
                self.lo = max(self.lo, self.hi - self.pool_size)
        return out

    def record(self, gets: int, hits: int) -> None:
        """Feedback after each batch: how many of its gets hit."""
        self.gets += gets
        self.hits += hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.gets if self.gets else 0.0
