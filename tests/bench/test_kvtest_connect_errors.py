"""`kvpool bench kvtest`: a mode's clients meet at a barrier once connected (405ff1c). A client whose
connect fails with anything but PoolUnavailable (an AuthError: the worker asks for a token this client
does not hold, or holds another) must end the mode with that error, not leave the bench waiting at the
barrier for ever."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvpool.core.bench import kvtest_suite
from kvpool.core.bench.kvtest_suite import KvtestOptions, _one
from kvpool.core.config import CacheConfig, WorkerConfig
from kvpool.core.errors import KVPoolError
from kvpool.core.server import Worker

_WAIT_S = 15.0


class _Barrier(threading.Barrier):
    made: list[threading.Barrier] = []

    def __init__(self, parties: int, *args: object, **kwargs: object) -> None:
        super().__init__(parties, *args, **kwargs)  # type: ignore[arg-type]
        _Barrier.made.append(self)


def test_a_client_refused_for_its_token_ends_the_mode_with_a_typed_error(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvtest_suite.threading, "Barrier", _Barrier)
    _Barrier.made.clear()
    w = Worker(WorkerConfig(port=0, token="another-pools-token", unix_path=str(tmp_path / "w.sock")),
               CacheConfig(dram_bytes=16 << 20, dram_slab_size=1 << 20, prefault=False)).start()
    outcome: list[BaseException | object] = []

    def mode() -> None:
        try:
            outcome.append(_one(KvtestOptions(modes=["set_cross_node"], sizes=[16 << 10], threads=2, ops=4),
                                "set_cross_node", 16 << 10, w.address, "r"))
        except BaseException as e:  # (what the mode ended with)
            outcome.append(e)

    t = threading.Thread(target=mode, daemon=True)
    try:
        t.start()
        t.join(_WAIT_S)
        hung = t.is_alive()
    finally:
        for b in _Barrier.made:  # let a hung mode (and its non-daemon threads) go
            b.abort()
        t.join(5)
        w.stop()
    assert not hung, f"the mode was still waiting at its barrier after {_WAIT_S} s"
    assert outcome and isinstance(outcome[0], KVPoolError), outcome
