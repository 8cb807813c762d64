"""The hit-rate controller reaches its target, also when the pool loses some of the window."""
from __future__ import annotations

import random

import pytest

from kvpool.core.bench.key_draw import KeyDraw


@pytest.mark.parametrize("target,keeps", [(0.8, 1.0), (0.5, 0.7), (0.0, 1.0), (1.0, 1.0)])
def test_reaches_target(target: float, keeps: float) -> None:
    """`keeps`: the chance a window key is still in the pool (evictions turn the rest into misses)."""
    rng = random.Random(1)
    draw = KeyDraw(target, pool_size=32, rng=random.Random(2))
    for _ in range(3000):
        fresh_before = draw.hi
        numbers = draw.draw(4)
        hits = sum(1 for n in numbers if n < fresh_before and rng.random() < keeps)
        draw.record(len(numbers), hits)
    assert draw.hit_rate == pytest.approx(target, abs=0.02)


def test_window_holds_the_latest_keys() -> None:
    draw = KeyDraw(0.0, pool_size=8, rng=random.Random(3))
    assert draw.draw(20) == list(range(20))  # target 0: every draw is a fresh key
    assert (draw.lo, draw.hi) == (12, 20)
    draw = KeyDraw(1.0, pool_size=8, rng=random.Random(3))
    draw.draw(1)
    draw.record(1, 0)
    assert set(draw.draw(50)) <= {0}  # only the one created key can be drawn again
