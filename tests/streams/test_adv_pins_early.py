"""Adversarial tests of the reconciler's early passes (`PinKeeper`: a pass at once when the pins take `EARLY`
of the budget, at least `_PASS_GAP_S` after the last, and after passes that released nothing `_IDLE_GAP_S`,
doubling each time).

Unit tests drive a real PinKeeper (its thread, lock, budget and pass logic) against a fake Link (the
stream's state: every message up to a floor is read) and a fake pool (records the pins it is asked for);
the others run a Producer against the test's nats-server and worker."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.core.client import PoolClient
from kvpool.streams import HandoffReceiver, Producer
from kvpool.streams import pins as pins_mod
from kvpool.streams.pins import PinKeeper

MiB = 1 << 20
RECONCILER = "kvpool-pins-"


class _ReadUpTo:
    """A stream state where every message up to `floor` is done (read), none after it."""

    def __init__(self, floor: int) -> None:
        self.floor = floor

    def done(self, seq: int, subj: str) -> bool:
        return seq <= self.floor


class _FakeLink:
    """Answers a pass's state request with the messages read so far (`floor`), counting the passes."""

    timeout_s = 1.0

    def __init__(self) -> None:
        self.floor = 0
        self.passes: list[float] = []  # when each pass asked
        self.on_call = None

    def call(self, coro, what: str, timeout: float | None = None):
        coro.close()  # (the real `_state` coroutine, never run)
        self.passes.append(time.monotonic())
        if self.on_call is not None:
            self.on_call()
        return _ReadUpTo(self.floor)


class _FakePool:
    """Records each pin request with the thread that made it and the reader's floor at that time."""

    def __init__(self, link: _FakeLink) -> None:
        self._link = link
        self.calls: list[tuple[str, list[str], float, int]] = []
        self.on_pin = None

    def batch_pin(self, keys, seconds: float) -> None:
        self.calls.append((threading.current_thread().name, list(keys), seconds, self._link.floor))
        if self.on_pin is not None:
            self.on_pin()

    def unpinned(self) -> list[tuple[str, int]]:
        """(key, floor at the unpin) for each key unpinned."""
        return [(k, floor) for _, keys, seconds, floor in self.calls if seconds <= 0 for k in keys]


@pytest.fixture
def keepers() -> Iterator[list[PinKeeper]]:
    made: list[PinKeeper] = []
    yield made
    for k in made:
        k.stop()
    for k in made:
        k._thread.join(2)


def _keeper(keepers: list[PinKeeper], budget: int | None, ttl_s: float = 60.0
            ) -> tuple[PinKeeper, _FakeLink, _FakePool]:
    link = _FakeLink()
    pool = _FakePool(link)
    k = PinKeeper(link, "s", pool, ttl_s, budget)  # type: ignore[arg-type]
    keepers.append(k)
    return k, link, pool


def _seq(key: str) -> int:
    return int(key[1:])


# --- defects ---------------------------------------------------------------------------------------------

def test_early_pins_a_reader_lagging_within_the_budget_loses_no_unread_pin(keepers, caplog):
    """A reader that reads as messages come, 4 behind and falling behind to 7 (70 of a 100-byte budget in
    flight), fits the budget: a pass at each message past half of it releases what it read, and nothing is
    dropped. (A rule that put the next early pass a quarter of the budget above what a pass left, at 105
    with 80 in flight, had the budget drop the oldest down to 75 first, among them messages not read yet,
    and log read ones as unread.)"""
    k, link, pool = _keeper(keepers, budget=100)
    with caplog.at_level(logging.WARNING, logger="kvpool.streams.pins"):
        for seq in range(1, 21):  # 10 bytes each, well within one period (1 s) of the reconciler
            link.floor = seq - 4 - max(0, seq - 10) // 3
            k.add(seq, "x", [f"k{seq}"], 10)
            time.sleep(0.02)  # (the pass it may have woken: a few microseconds against the fake link)
    unread_unpinned = sorted(key for key, floor in pool.unpinned() if _seq(key) > floor)
    assert unread_unpinned == [], f"pins of unread messages dropped: {unread_unpinned}"
    assert not [m for m in caplog.messages if "max_pinned_bytes" in m]


def test_early_pins_a_handoff_read_one_request_behind_is_released_not_dropped(nats, make_stream, pool,
                                                                               monkeypatch, caplog):
    """The same on a real stream: a decode side that reads each request once the next one is published
    (two requests of 4 x 1 MiB in flight, within a 10 MiB budget): early passes release each read request
    before the budget is reached, and the budget drops nothing."""
    dropped_by_budget: list[str] = []
    real = PoolClient.batch_pin

    def batch_pin(self: PoolClient, keys, seconds: float) -> None:
        if seconds <= 0 and not threading.current_thread().name.startswith(RECONCILER):
            dropped_by_budget.extend(keys)
        real(self, keys, seconds)

    monkeypatch.setattr(PoolClient, "batch_pin", batch_pin)
    s = make_stream()
    layers = 4
    with caplog.at_level(logging.WARNING, logger="kvpool.streams.pins"), \
            Producer(s, nats.url, pool, pin_ttl_s=60, max_pinned_bytes=10 * MiB, hold_s=0) as p, \
            HandoffReceiver(s, nats.url, pool) as rx:
        for r in range(3):
            for layer in range(layers):
                p.publish_kv(f"r{r}", layer, [f"r{r}/L{layer}"], [bytes([r]) * MiB])
                p.flush()  # stored: counted against the budget
                time.sleep(0.03)  # (the early pass it may have woken)
            p.end_request(f"r{r}", layers)
            p.flush()
            if r:  # the decode side reads the request before, now the next one is out
                got = [bytes(bufs[0]) for _, _, bufs in rx.iter_layers(f"r{r - 1}", timeout=5)]
                assert got == [bytes([r - 1]) * MiB] * layers
                time.sleep(0.05)  # (its purge, in the background)
        assert dropped_by_budget == []
        assert not [m for m in caplog.messages if "max_pinned_bytes" in m]


def test_early_pins_a_zero_budget_does_not_pass_at_every_message(nats, make_stream, pool, monkeypatch):
    """max_pinned_bytes=0 (keep only the newest message's blocks pinned) is taken as is: no early pass (a
    pass, STREAM.INFO plus the consumer list, at every message nobody reads would release nothing)."""
    passes = []
    reconcile = PinKeeper.reconcile
    monkeypatch.setattr(PinKeeper, "reconcile", lambda keeper: (passes.append(1), reconcile(keeper))[1])
    s = make_stream()
    block = bytes(16 << 10)
    with Producer(s, nats.url, pool, pin_ttl_s=60, max_pinned_bytes=0, hold_s=0) as p:  # a message a layer
        started = time.monotonic()
        for layer in range(300):
            p.publish_kv("r", layer, [f"r/L{layer}"], [block])
            if layer % 10 == 9:
                time.sleep(0.006)  # (a producer with a little compute between layers)
        p.flush()
        periodic = int(time.monotonic() - started)  # (a pass a second besides: the period's)
        assert len(passes) <= 6 + periodic, f"{len(passes)} passes for 300 messages nobody reads"


# --- regressions -----------------------------------------------------------------------------------------

def test_early_pins_messages_larger_than_the_budget_make_few_passes(keepers):
    """Each message alone over the budget (the newest always stays pinned), nothing read: the early passes
    release nothing, and come ever further apart, not one per message."""
    for budget in (1, 100):
        k, link, _ = _keeper(keepers, budget=budget)
        link.floor = -1  # nothing read
        for seq in range(1, 41):
            k.add(seq, "x", [f"k{seq}"], 150)
            time.sleep(0.003)
        time.sleep(0.02)
        assert 1 <= len(link.passes) <= 4, (budget, len(link.passes))  # (at 0, 20, 60 ms; 140 at the latest)
        assert k._pinned_bytes == 150 and list(k._sizes) == [40]


def test_early_pins_no_budget_means_no_early_pass(keepers):
    k, link, pool = _keeper(keepers, budget=None)
    for seq in range(1, 201):
        k.add(seq, "x", [f"k{seq}"], 1 << 30)
    time.sleep(0.05)
    assert link.passes == [] and pool.calls == []  # (the period's pass, a second later, only)
    assert k._pinned_bytes == 200 << 30


def test_early_pins_unread_messages_stay_pinned_through_early_passes(keepers):
    """Early passes within the budget release only what was read, whatever their number."""
    k, link, pool = _keeper(keepers, budget=100)
    link.floor = 3
    for seq in range(1, 10):  # 90 of 100: passes at 50 and 75, no drop
        k.add(seq, "x", [f"k{seq}", "shared"], 10)
        time.sleep(0.01)
    assert len(link.passes) >= 1
    assert sorted(pool.unpinned()) == [("k1", 3), ("k2", 3), ("k3", 3)]  # "shared" still named by 4..9
    assert k._pinned_bytes == 60 == sum(k._sizes.values())


def test_early_pins_stop_from_the_reconciler_thread_ends_it_after_that_pass(keepers):
    """stop() may run on the reconciler's own thread (its doc says so): the pass under way ends, no other."""
    k, link, pool = _keeper(keepers, budget=100)
    link.on_call = k.stop
    for seq in range(1, 7):
        k.add(seq, "x", [f"k{seq}"], 10)  # past 50: an early pass, which stops the keeper
    k._thread.join(1)
    assert not k._thread.is_alive()
    for seq in range(7, 11):
        k.add(seq, "x", [f"k{seq}"], 10)  # (wakes nothing any more)
    time.sleep(0.02)
    assert len(link.passes) == 1


def test_early_pins_close_is_prompt_makes_one_last_pass_and_may_come_again(keepers):
    """close() does not wait for the period (1 s here), joins the thread and makes one last pass; after
    stop() as well; a second close() neither hangs nor raises."""
    for stop_first in (False, True):
        k, link, pool = _keeper(keepers, budget=100)
        link.floor = 1
        k.add(1, "x", ["k1"], 10)
        k.add(2, "x", ["k2"], 10)  # (20 of 100: no early pass)
        time.sleep(0.01)
        assert link.passes == []
        if stop_first:
            k.stop()
        started = time.monotonic()
        k.close()
        assert time.monotonic() - started < 0.5
        assert not k._thread.is_alive()
        assert len(link.passes) == 1 and pool.unpinned() == [("k1", 1)]
        k.close()
        assert len(link.passes) == 2 and pool.unpinned() == [("k1", 1)]


def test_early_pins_concurrent_adds_and_passes_keep_the_count_and_the_threshold_sane(keepers):
    """Adds on several threads (as announcers' ack threads would) against early passes and budget drops:
    the pinned bytes stay the sum of the counted messages, never negative; passes stay at least
    `_PASS_GAP_S` apart."""
    k, link, pool = _keeper(keepers, budget=1000)
    seqs = iter(range(1, 100_000))
    seq_lock = threading.Lock()
    stop_at = time.monotonic() + 0.3

    def producer() -> None:
        while time.monotonic() < stop_at:
            with seq_lock:
                seq = next(seqs)
                link.floor = seq - 30  # read 30 behind
            k.add(seq, "x", [f"k{seq}"], 7 + seq % 13)

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.02)
    with k._lock:
        assert k._pinned_bytes == sum(k._sizes.values()) >= 0
        assert set(k._sizes) <= set(k._messages)
    gaps = [b - a for a, b in zip(link.passes, link.passes[1:])]
    assert gaps and min(gaps) >= pins_mod._PASS_GAP_S
