"""Whom a put tells below a key's owners (`kvpool.core.succession.told_below`), and since when a worker
tells that it may hold its blocks (`kvpool.core.held_since.HeldSince`)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.cluster import rank
from kvpool.core.held_since import HeldSince
from kvpool.core.records import WorkerInfo
from kvpool.core.succession import MARGIN_S, told_below


def members(**joined_held: tuple[float | None, float]) -> dict[str, WorkerInfo]:
    """Worker id -> (member since, held since)."""
    return {w: WorkerInfo(worker_id=w, member_since=m, held_since=h) for w, (m, h) in joined_held.items()}


def test_a_cluster_whose_workers_joined_before_they_held_anything_tells_the_one_next_in_line_only() -> None:
    live = members(a=(100.0, 200.0), b=(101.0, 200.0), c=(102.0, 200.0), d=(103.0, 200.0))
    assert told_below(["c", "a", "d", "b"], 1, live) == ["a"]
    assert told_below(["c", "a", "d", "b"], 2, live) == ["d"]


def test_a_worker_that_held_blocks_before_those_above_it_joined_is_told() -> None:
    live = members(old=(100.0, 100.0), a=(500.0, 500.0), b=(600.0, 600.0))
    assert told_below(["b", "a", "old"], 1, live) == ["a", "old"]  # two joiners both rank above it
    live = members(old=(100.0, 100.0), a=(500.0, 500.0), b=(50.0, 60.0))
    assert told_below(["b", "a", "old"], 1, live) == ["a"]  # b was above it all along


def test_with_two_copies_a_worker_is_told_until_two_of_those_above_it_are_older() -> None:
    live = members(x=(0.0, 10.0), y=(500.0, 500.0), z=(600.0, 600.0), w=(100.0, 100.0))
    assert told_below(["z", "y", "x", "w"], 2, live) == ["x", "w"]  # only x above w is older
    live = members(x=(0.0, 10.0), y=(1.0, 10.0), z=(600.0, 600.0), w=(100.0, 100.0))
    assert told_below(["z", "y", "x", "w"], 2, live) == ["x"]


def test_joins_within_the_margin_and_unknown_ones_do_not_count_as_older() -> None:
    live = members(a=(100.0 - MARGIN_S / 2, 300.0), b=(None, 300.0), old=(90.0, 100.0))
    assert told_below(["a", "b", "old"], 1, live) == ["b", "old"]
    live = members(a=(100.0 - 2 * MARGIN_S, 300.0), b=(None, 300.0), old=(90.0, 100.0))
    assert told_below(["a", "b", "old"], 1, live) == ["b"]


def test_no_worker_below_the_owners_is_told_nothing() -> None:
    live = members(a=(0.0, 0.0), b=(0.0, 0.0))
    assert told_below(["a", "b"], 2, live) == []
    assert told_below(["a"], 1, live) == []


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=9), st.integers(1, 3))
def test_told_below_is_its_definition(times: list[tuple[int, int]], r: int) -> None:
    """The first below the owners, then each worker fewer than `r` of those above it joined more than
    the margin before it began to hold its blocks."""
    ids = [f"w{i}" for i in range(len(times))]
    live = {w: WorkerInfo(worker_id=w, member_since=float(m), held_since=float(h)) for w, (m, h) in zip(ids, times)}
    want = ids[r:r + 1] + [w for i, w in enumerate(ids) if i > r and sum(
        live[v].member_since + MARGIN_S < live[w].held_since for v in ids[:i]) < r]  # type: ignore[operator]
    assert told_below(ids, r, live) == want


OPS = st.lists(st.tuples(st.sampled_from(["join", "join", "leave", "restart", "write", "write", "evict"]),
                         st.integers(0, 3), st.integers(0, 2), st.integers(0, 4)), max_size=30)


@settings(max_examples=3000, deadline=None)
@given(OPS, st.integers(1, 2))
def test_no_member_keeps_an_older_copy_whatever_the_joins_and_leaves(ops: list[tuple[str, int, int, int]],
                                                                      r: int) -> None:
    """A model of a cluster: workers join, leave (their blocks gone), restart on their blocks (a catch-up
    drops what changed while they were away) and evict everything; each write goes to the key's owners
    and is told to `told_below` of them. No member ever holds an older copy of a key than its newest
    write, so none can serve one, whichever workers leave later."""
    now = 0.0
    member_since: dict[str, float] = {}
    held: dict[str, dict[bytes, int]] = {f"w{i}": {} for i in range(4)}
    held_since: dict[str, float | None] = dict.fromkeys(held)
    newest: dict[bytes, int] = {}
    for version, (op, wi, key, dt) in enumerate(ops, 1):
        now += dt
        w, k = f"w{wi}", f"k{key}".encode()
        if op in ("leave", "restart") and w in member_since:
            del member_since[w]
            if op == "leave":
                held[w], held_since[w] = {}, None
        elif op in ("join", "restart") and w not in member_since:
            member_since[w] = now
            held[w] = {k: v for k, v in held[w].items() if v == newest[k]}  # the catch-up
        elif op == "evict":
            held[w], held_since[w] = {}, None
        elif op == "write" and member_since:
            live = {m: WorkerInfo(worker_id=m, member_since=since, held_since=now if held_since[m] is None
                                  else held_since[m]) for m, since in member_since.items()}
            ranking = rank(k, list(live))
            for o in ranking[:r]:
                held[o][k] = version
                held_since[o] = now if held_since[o] is None else held_since[o]
            for b in told_below(ranking, r, live):
                if held[b].get(k, version) < version:
                    del held[b][k]
            newest[k] = version
        for m in member_since:
            stale = {key: v for key, v in held[m].items() if v < newest[key]}
            assert not stale, f"{m} holds older copies {stale} (newest {newest})"


def test_held_since_is_the_last_time_nothing_was_held_and_outlives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "w.held"
    held = HeldSince(path, holds=False)
    first = held.now(holds=False)
    assert abs(first - time.time()) < 5
    time.sleep(0.01)
    assert held.now(holds=True) == first  # blocks taken since then
    time.sleep(0.01)
    assert held.now(holds=True) == first
    assert HeldSince(path, holds=True).now(holds=True) == pytest.approx(first, abs=1e-3)  # a restart on them
    later = held.now(holds=False)  # all evicted: from now on
    assert later > first
    assert held.now(holds=True) == later


def test_blocks_of_unknown_age_count_as_held_forever(tmp_path: Path) -> None:
    assert HeldSince(tmp_path / "none.held", holds=True).now(holds=True) == 0.0
    (tmp_path / "bad.held").write_text("yesterday\n")
    assert HeldSince(tmp_path / "bad.held", holds=True).now(holds=True) == 0.0
    assert HeldSince(tmp_path / "bad.held", holds=False).now(holds=False) > 0.0  # nothing held: no age to tell
