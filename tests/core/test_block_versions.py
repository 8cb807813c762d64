"""Block versions (`kvpool.core.versions`): the hybrid logical clock, tombstones, the change log, and a
cache that keeps the newest version of each key whatever order puts and removes reach it in."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.core.blocks import BlockMeta, checksum, decode_header, encode_header
from kvpool.core.cache import TieredCache
from kvpool.core.versions import (
    CLEAR,
    CLOCK_SKEW_MS,
    COUNTER_BITS,
    PUT,
    REMOVE,
    ChangeLog,
    HybridClock,
    Tombstones,
    wall_ms_of,
)


def test_the_clock_follows_wall_time_and_never_goes_back() -> None:
    clock = HybridClock()
    before = int(time.time() * 1000)
    v = clock.now()
    assert before <= wall_ms_of(v) <= int(time.time() * 1000)
    seen = [clock.now() for _ in range(10_000)]  # many per millisecond: the counter orders them
    assert seen == sorted(set(seen)) and seen[0] > v
    batch = clock.batch(5)
    assert batch == list(range(batch[0], batch[0] + 5)) and batch[0] > seen[-1]


def test_the_clock_merges_versions_it_sees() -> None:
    clock = HybridClock()
    ahead = (int(time.time() * 1000) + CLOCK_SKEW_MS // 2) << COUNTER_BITS  # a writer whose clock runs ahead
    clock.observe(ahead)
    assert clock.now() > ahead  # a write after reading it is stamped above it
    clock.observe(5)  # an old version changes nothing
    assert clock.now() > ahead


@pytest.mark.parametrize("days", [1, 10**9])
def test_a_version_from_beyond_the_clock_skew_moves_the_clock_only_that_far(days: int) -> None:
    clock = HybridClock()
    forged = min((int(time.time() * 1000) + days * 86_400_000) << COUNTER_BITS, (1 << 64) - 2)
    clock.observe(forged)  # e.g. a stream message naming a version of its own making
    assert wall_ms_of(clock.now()) <= int(time.time() * 1000) + CLOCK_SKEW_MS
    assert clock.batch_array(3).size == 3  # no overflow past the u64


def test_the_clock_is_monotonic_across_threads() -> None:
    clock = HybridClock()
    out: list[list[int]] = [[] for _ in range(4)]

    def run(i: int) -> None:
        out[i] = [clock.now() for _ in range(5000)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [v for part in out for v in part]
    assert len(set(every)) == len(every)  # no two writers share a version
    assert all(part == sorted(part) for part in out)


def test_tombstones_are_bounded_in_count_and_time(monkeypatch: pytest.MonkeyPatch) -> None:
    marks = Tombstones(keep_s=10.0, max_keys=3)
    for i, k in enumerate([b"a", b"b", b"c", b"d"]):
        marks.add(k, 100 + i)
    assert len(marks) == 3 and marks.version(b"a") == 0  # the oldest went first
    assert marks.version(b"d") == 103
    marks.add(b"d", 50)  # an older removal does not lower a newer one
    assert marks.version(b"d") == 103
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 11.0)
    assert marks.version(b"d") == 0 and len(marks) == 0  # past keep_s: gone


def test_the_change_log_pages_and_says_how_far_back_it_reaches() -> None:
    log = ChangeLog(covered_since_ms=1000, max_entries=4)
    log.record([b"a", b"b"], [1, 2], False)
    time.sleep(0.002)
    t = int(time.time() * 1000)
    log.record([b"c"], [3], True)
    changes, nxt = log.since(t)
    assert [(c.key, c.version, c.kind) for c in changes] == [(b"c", 3, REMOVE)] and nxt == -1
    first, nxt = log.since(0, limit=2)
    assert [c.key for c in first] == [b"a", b"b"] and nxt == 2
    rest, nxt = log.since(0, from_seq=nxt, limit=2)
    assert [c.key for c in rest] == [b"c"] and nxt == -1
    assert log.covered_since_ms == 1000
    log.record([b"d", b"e"], [4, 5], False)  # five entries in a log of four: the first goes
    assert len(log) == 4 and log.covered_since_ms > 1000
    assert [c.key for c in log.since(0)[0]] == [b"b", b"c", b"d", b"e"]
    b_ms, d_ms = log.since(0)[0][0].at_ms, log.since(0)[0][2].at_ms
    assert b_ms < d_ms  # (b came before the sleep)
    log.record([b"f", b"g", b"h"], [6, 7, 8], False)  # three go at once (b, c, d); sequence numbers hold
    assert [c.key for c in log.since(0)[0]] == [b"e", b"f", b"g", b"h"] and log.covered_since_ms == d_ms + 1
    assert [c.key for c in log.since(0, from_seq=6)[0]] == [b"g", b"h"]  # a0 b1 c2 d3 e4 f5 g6 h7


@pytest.mark.parametrize("seed", range(4))
def test_the_change_log_keeps_what_a_flat_list_of_its_last_changes_would(seed: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The log keeps each record's changes together and trims change by change: against a plain list of
    every change (key, version, kind, at_ms) cut to its last `max_entries`, over records of 0-9 changes
    at times that step on (some the same), every page of `since`, `puts_since` from every sequence
    number, the log's length and how far back it covers hold."""
    import random

    rng = random.Random(seed)
    clock = [1_000_000]
    monkeypatch.setattr(time, "time", lambda: clock[0] / 1000)
    log = ChangeLog(covered_since_ms=500, max_entries=rng.choice((1, 5, 17)))
    flat: list[tuple[bytes, int, int, int]] = []
    covered, version = 500, 0
    for step in range(120):
        clock[0] += rng.choice((0, 0, 1, 3))
        kind = rng.choice((PUT, PUT, REMOVE, CLEAR))
        n = 1 if kind == CLEAR else rng.randint(0, 9)
        keys = [b"k%d" % rng.randint(0, 30) for _ in range(n)]
        versions = list(range(version, version + n))
        version += n
        if kind == CLEAR:
            log.record_clear(keys[0], versions[0])
        else:
            log.record(keys, versions, kind == REMOVE)
        flat += [(k, v, kind, clock[0]) for k, v in zip(keys, versions)]
        first = max(len(flat) - log.max_entries, 0)
        if first and flat[first - 1][3] + 1 > covered:
            covered = flat[first - 1][3] + 1
        held = flat[first:]
        assert len(log) == len(held) and log.next_seq == len(flat) and log.covered_since_ms == covered
        for seq in range(len(flat) + 1):
            want = None if seq < first else {k for k, _, kd, _ in flat[seq:] if kd == PUT}
            assert log.puts_since(seq) == want, (step, seq)
        for since_ms in {0, clock[0] - 2, clock[0], clock[0] + 1}:
            at = next((i for i, c in enumerate(held) if c[3] >= since_ms), len(held))
            got, nxt, pages = [], 0, 0
            while nxt != -1 and pages < 100:  # pages of 4 from the sequence numbers returned
                page, nxt = log.since(since_ms, from_seq=nxt, limit=4) if pages else log.since(since_ms, limit=4)
                got += [(c.key, c.version, c.kind, c.at_ms) for c in page]
                pages += 1
            assert got == held[at:], (step, since_ms)


def test_the_ssd_header_carries_the_version() -> None:
    meta = BlockMeta(10, 1234, 0.0, 987654321)
    assert decode_header(encode_header(meta)) == meta


def test_an_altered_header_field_is_refused_when_read_and_when_scanned(tmp_path: Path) -> None:
    """The payload's checksum does not cover the header: one flipped bit in a block's version made it
    newer than every later write of its key. Each field is checked (header version 3); a version-2
    header (no check) is still read, one that claims version 2 with a check in it is not."""
    import struct

    from kvpool.core.blocks import CorruptBlock
    from kvpool.core.tiers import ssd_index
    from kvpool.core.tiers.ssd import SsdStore

    raw = encode_header(BlockMeta(10, 1234, 99.5, 987654321))
    for offset in range(4, len(raw)):  # every bit of the version, the check and the fields
        for bit in range(8):
            bad = bytearray(raw)
            bad[offset] ^= 1 << bit
            with pytest.raises(CorruptBlock):
                decode_header(bytes(bad))
    older = struct.pack("<4sHHQQdQ", b"KVB1", 2, 0, 10, 1234, 0.0, 5)
    assert decode_header(older) == BlockMeta(10, 1234, 0.0, 5)
    with pytest.raises(CorruptBlock):
        decode_header(older[:6] + b"\x01\x00" + older[8:])
    store = SsdStore(tmp_path / "lmdb", map_size=16 << 20, sync=False)
    try:
        good = encode_header(BlockMeta(4, checksum(b"good"), 0.0, 7)) + b"good"
        rotted = bytearray(encode_header(BlockMeta(4, checksum(b"rots"), 0.0, 7)) + b"rots")
        rotted[39] ^= 0x40  # the top byte of the block's version
        with store.env.begin(write=True) as txn:
            txn.put(b"good", good)
            txn.put(b"rotted", bytes(rotted))
            txn.put(b"older", older + b"\0" * 10)
        snap = ssd_index.scan(store)
        assert sorted(snap.sizes) == [b"good", b"older"] and store.corrupt == 1
        assert snap.versions[b"good"] == 7 and snap.versions[b"older"] == 5
    finally:
        store.close()


@pytest.fixture
def cache(make_cache: Callable[..., TieredCache]) -> TieredCache:
    return make_cache()


def test_an_older_put_changes_nothing(cache: TieredCache) -> None:
    cache.batch_put(["k"], [b"new"], versions=[200])
    cache.batch_put(["k"], [b"old"], versions=[100])  # arrives late: ignored, no error
    assert cache.get("k") == b"new"
    cache.batch_put(["k"], [b"same"], versions=[200])  # the same version again: the one held stays
    assert cache.get("k") == b"new"
    cache.batch_put(["k"], [b"newer"], versions=[300])
    assert cache.get("k") == b"newer"
    assert cache.replicas.batch_versions([b"k", b"none"]) == ([True, False], [300, 0])
    assert cache.check() == []


def test_a_removal_leaves_a_tombstone_that_stops_older_puts(cache: TieredCache) -> None:
    cache.batch_put(["k", "j"], [b"v1", b"v1"], versions=[100, 100])
    assert cache.batch_remove(["k"], versions=[200]) == [True]
    cache.batch_put(["k"], [b"v1-late"], versions=[150])  # older than the removal: stays removed
    assert cache.get("k") is None
    assert cache.replicas.batch_versions([b"k"]) == ([False], [200])
    assert cache.replicas.removed_versions([b"k", b"j"]) == [200, 0]
    cache.batch_put(["k"], [b"v3"], versions=[250])  # newer than the removal: stored
    assert cache.get("k") == b"v3"
    assert cache.batch_remove(["j"], versions=[50]) == [False]  # older than the block: it stays
    assert cache.get("j") == b"v1"


def test_a_supersede_drops_only_older_blocks_held_and_is_logged_for_peers(cache: TieredCache) -> None:
    """What the worker next in line hears after a put or remove elsewhere (`Op.SUPERSEDE`): a block
    stamped before the version elsewhere, or less than the clock skew after it, goes, with a tombstone
    just below the version (a replica answering with that version's block still wins a read: a removal
    would win the tie); a block stamped later stays; a key not held gets no tombstone. Each is in the
    change log as a put of its version, for a peer catching up (its owner may have left by then)."""
    skew = CLOCK_SKEW_MS << COUNTER_BITS
    cache.batch_put(["old", "ahead", "new"], [b"v1", b"v2", b"v3"], versions=[100, 200 + skew - 1, 200 + skew])
    assert cache.replicas.supersede([b"old", b"ahead", b"new", b"none"], [200, 200, 200, 200]) == 2
    assert [cache.get(k) for k in ("old", "ahead", "new")] == [None, None, b"v3"]
    assert cache.replicas.removed_versions([b"old", b"none"]) == [199, 0]
    cache.batch_put(["old", "none"], [b"v2", b"v1"], versions=[200, 100])  # that version itself is welcome;
    assert [cache.get(k) for k in ("old", "none")] == [b"v2", b"v1"]      # a key not held: any put
    changes, _, _ = cache.replicas.changes_since(0)
    told = [(c.key, c.version, c.kind) for c in changes if c.version == 200]  # (the last: the put of "old")
    assert told == [(k, 200, PUT) for k in (b"old", b"ahead", b"new", b"none", b"old")]


def test_a_batch_committed_unstamped_is_logged_with_the_versions_it_was_stamped(cache: TieredCache) -> None:
    """A same-node batch without versions is stamped as it is committed: the change log carries those
    stamps (a peer catching up compares them), not the 0s it came with; a batch with some stale blocks
    logs only those stored."""
    offsets = cache.reserve_many([3, 3])
    for off in offsets:
        cache.arena.view(off, 3)[:] = b"abc"
    assert cache.commit_many([b"s1", b"s2"], offsets, [3, 3], [checksum(b"abc")] * 2) == [True, True]
    held = cache.replicas.batch_versions([b"s1", b"s2"])[1]
    logged = [(c.key, c.version) for c in cache.replicas.changes_since(0)[0]]
    assert logged == [(b"s1", held[0]), (b"s2", held[1])] and 0 < held[0] < held[1]
    offsets = cache.reserve_many([3, 3])
    for off in offsets:
        cache.arena.view(off, 3)[:] = b"abc"
    got = cache.commit_many([b"s1", b"s3"], offsets, [3, 3], [checksum(b"abc")] * 2, [held[0] - 1, held[1] + 1])
    assert got == [False, True]
    assert [(c.key, c.version) for c in cache.replicas.changes_since(0)[0]][2:] == [(b"s3", held[1] + 1)]


def test_a_clear_stops_older_puts_under_it_and_is_told_to_peers(cache: TieredCache) -> None:
    """One mark per clear, however many keys it covered (or none it held): a key under it reads as removed
    as of the clear; a late put older than the clear changes nothing; a newer one, or one outside, is
    stored; the change log carries the clear for a peer catching up."""
    cache.batch_put(["p1", "q1"], [b"v", b"v"], versions=[100, 100])
    cache.clear("p")
    (held, (cleared,)) = cache.replicas.batch_versions([b"p9"])
    assert held == [False] and cleared > 100
    cache.batch_put(["p1", "p2", "q2"], [b"late", b"late", b"late"], versions=[150, 150, 150])
    assert [cache.get(k) for k in ("p1", "p2", "q1", "q2")] == [None, None, b"v", b"late"]
    assert cache.replicas.removed_versions([b"p2", b"q2"]) == [cleared, 0]
    cache.batch_put(["p1"], [b"new"], versions=[cleared + 1])
    assert cache.get("p1") == b"new"
    changes, _, _ = cache.replicas.changes_since(0)
    assert (b"p", cleared, CLEAR) in [(c.key, c.version, c.kind) for c in changes]
    cache.clear()  # everything: one mark covers every prefix
    assert cache.replicas.batch_versions([b"zzz"])[1][0] > cleared
    assert cache.commit_many([], [], [], []) == []  # (an empty same-node COMMIT after a clear)


def test_a_worker_dropping_its_own_blocks_remembers_no_clear(cache: TieredCache) -> None:
    """A worker that cannot vouch for its blocks drops them (`drop_all`): that says nothing of the keys
    as its peers hold them, so it must not answer "removed" for them, nor tell a clear to a peer."""
    cache.batch_put(["k"], [b"v"], versions=[100])
    cache.drop_all()
    assert cache.get("k") is None
    assert cache.replicas.batch_versions([b"k", b"other"]) == ([False, False], [0, 0])
    assert CLEAR not in [c.kind for c in cache.replicas.changes_since(0)[0]]


def test_clears_go_over_the_wire_whatever_their_prefix() -> None:
    from kvpool.core import protocol as P
    from kvpool.core.keys import MAX_KEY_BYTES
    from kvpool.core.versions import Change, Clears

    longest = b"p" * MAX_KEY_BYTES  # covers one key: it goes as that key's removal
    sent = [Change(b"", 5, CLEAR, 0), Change(b"ns/", 6, CLEAR, 0), Change(longest, 7, CLEAR, 0),
            Change(b"k", 8, PUT, 0), Change(b"*k", 9, REMOVE, 0)]
    got = [(c.key, c.version, c.kind) for c in P.unpack_changes(P.pack_changes(sent))]
    assert got == [(b"", 5, CLEAR), (b"ns/", 6, CLEAR), (longest, 7, REMOVE), (b"k", 8, PUT), (b"*k", 9, REMOVE)]
    marks = Clears(max_marks=2)
    for prefix, version in ((b"a/", 100), (b"b/", 50), (b"c/", 10)):  # (as catch-up may bring them)
        marks.add(prefix, version)
    assert [marks.version(k) for k in (b"a/1", b"b/1", b"c/1", b"d/1")] == [100, 50, 0, 0]  # the oldest went


def test_catching_up_on_a_clear_drops_what_it_covered(cache: TieredCache) -> None:
    cache.batch_put(["p1", "p2", "q1"], [b"old", b"new", b"old"], versions=[10, 30, 10])
    assert cache.replicas.apply_changes([(b"p", 20, CLEAR)]) == 1  # p2 is newer than the clear: it stays
    assert [cache.get(k) for k in ("p1", "p2", "q1")] == [None, b"new", b"old"]
    cache.batch_put(["p3"], [b"late"], versions=[15])
    assert cache.get("p3") is None
    assert cache.check() == []


def test_a_same_node_commit_keeps_the_newest(cache: TieredCache) -> None:
    cache.batch_put(["k"], [b"held"], versions=[500])
    off = cache.reserve(5)
    cache.arena.view(off, 5)[:] = b"stale"
    from kvpool.core.blocks import checksum

    assert cache.commit("k", off, 5, checksum(b"stale"), version=400) is False  # the slot is freed
    assert cache.get("k") == b"held"
    assert cache.check() == []


def test_unversioned_writes_are_stamped_in_order(cache: TieredCache) -> None:
    """Embedded mode: the cache stamps its own puts and removes; put, remove, put behaves as always."""
    cache.put("k", b"a")
    cache.remove("k")
    assert cache.get("k") is None
    cache.put("k", b"b")
    assert cache.get("k") == b"b"
    assert cache.replicas.batch_versions([b"k"])[1][0] > 0


def test_catching_up_drops_what_is_older_and_fences_reads(cache: TieredCache) -> None:
    cache.batch_put(["a", "b", "c"], [b"a0", b"b0", b"c0"], versions=[10, 10, 10])
    dropped = cache.replicas.apply_changes([(b"a", 20, False), (b"b", 20, True), (b"c", 5, False)])
    assert dropped == 2
    assert [cache.get(k) for k in "abc"] == [None, None, b"c0"]
    cache.batch_put(["a"], [b"a-stale"], versions=[15])  # older than what was missed: refused
    assert cache.get("a") is None
    cache.batch_put(["a"], [b"a20"], versions=[20])  # the version missed itself is welcome
    assert cache.get("a") == b"a20"
    cache.replicas.fence(True)
    assert cache.get("c") is None and cache.batch_exists(["c"]) == [False]  # may be outdated: a miss
    cache.put("d", b"early")  # stamped within the clock skew of the fence: it may be older than a miss
    assert cache.get("d") is None
    later = (int(time.time() * 1000) + 3000) << COUNTER_BITS  # past the fence by more than the skew
    cache.batch_put(["e"], [b"fresh"], versions=[later])
    assert cache.get("e") == b"fresh"
    cache.replicas.fence(False)
    assert cache.get("c") == b"c0"


def test_versions_survive_a_reopen_of_the_ssd_tier(make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    c = make_cache(ssd_path=ssd_dir)
    c.batch_put(["k"], [b"x" * 100], versions=[777])
    c.flush()
    c.close()
    again = make_cache(ssd_path=ssd_dir)
    assert again.replicas.batch_versions([b"k"]) == ([True], [777])
    again.batch_put(["k"], [b"y" * 100], versions=[700])
    assert again.get("k") == b"x" * 100
