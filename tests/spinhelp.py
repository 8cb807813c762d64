"""What the checks of a client's spin for its worker's answers share (`kvpool.core.reply_spin`)."""
from __future__ import annotations

import numpy as np
import pytest

from kvpool.core import _native, reply_spin


def counting_spins(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """Record each native spin (fd, spin_us) while doing it for real."""
    seen: list[tuple[int, float]] = []
    real = _native.spin_readable

    def counting(fd: int, spin_us: float) -> bool:
        seen.append((fd, spin_us))
        return bool(real(fd, spin_us))

    monkeypatch.setattr(reply_spin, "spin_readable", counting)
    return seen


def random_blocks(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
