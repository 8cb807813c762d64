"""Reopening the SSD tier: from the index saved beside LMDB at a clean close, or by a scan of every header
when that index is missing, corrupt, stale or written over by another writer. Whichever way, a hit returns
the bytes last put, a removed block stays removed and an expired one stays expired."""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from kvpool.core import TieredCache
from kvpool.core.blocks import BlockMeta, checksum, encode_header
from kvpool.core.tiers import ssd_index
from kvpool.core.tiers.ssd import SsdStore
from kvpool.core.tiers.ssd_tier import SsdTier

from corehelp import MiB, payload

KEYS = [f"reopen-{i}" for i in range(40)]


def index_file(ssd_dir: str) -> Path:
    return Path(ssd_dir) / ssd_index.FILE_NAME


def fill(cache: TieredCache, keys: list[str] = KEYS, size: int = 3000) -> None:
    cache.batch_put(keys, [payload(k, size) for k in keys])
    cache.flush()


def assert_serves(cache: TieredCache, want: dict[str, bytes | None]) -> None:
    """Every key gives exactly its bytes, or a miss where `want` says None; the books are consistent."""
    for k, v in want.items():
        assert cache.get(k) == v, k
        assert cache.exists(k) == (v is not None), k
    assert cache.check() == []


def test_a_clean_close_saves_the_index_and_the_reopen_uses_it(make_cache: Callable[..., TieredCache],
                                                                 ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache)
    cache.put("ttl", payload("ttl", 100), ttl_s=3600)
    cache.flush()
    cache.close()
    assert index_file(ssd_dir).exists()
    again = make_cache(ssd_path=ssd_dir)
    assert again.ssd is not None and again.ssd.opened_from == "index"
    assert not index_file(ssd_dir).exists()  # consumed: never trusted twice
    assert again.check() == []
    assert again.ssd.expired(b"ttl", time.time() + 7200) and not again.ssd.expired(b"ttl", time.time())
    assert_serves(again, {**{k: payload(k, 3000) for k in KEYS}, "ttl": payload("ttl", 100)})


def test_the_eviction_order_survives_the_reopen(make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache)
    cache.close()
    cache = make_cache(ssd_path=ssd_dir)
    for k in reversed(KEYS[:10]):  # promotions touch them on SSD: now the last to go, in this order
        assert cache.get(k) == payload(k, 3000)
    assert cache.ssd is not None
    order = list(cache.ssd._order)
    cache.close()
    again = make_cache(ssd_path=ssd_dir)
    assert again.ssd is not None and again.ssd.opened_from == "index"
    assert list(again.ssd._order) == order
    assert order[-10:] == [k.encode() for k in reversed(KEYS[:10])]


def test_blocks_of_one_size_under_keys_of_one_length_reopen_with_their_sizes_versions_and_order(
        make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    """The usual tier (its index read with one shared size and the keys cut as fixed-width cells) gives
    each block back exactly, with its version, in its eviction order, as the scan does."""
    keys = [f"{i:064x}" for i in range(300)]
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache, keys, 4096)
    assert cache.ssd is not None
    versions, order = [cache.ssd.version_of(k.encode()) for k in keys], list(cache.ssd._order)
    cache.close()
    for source in ("index", "scan"):
        if source == "scan":
            index_file(ssd_dir).unlink()
        again = make_cache(ssd_path=ssd_dir)
        assert again.ssd is not None and again.ssd.opened_from == source
        assert [again.ssd.version_of(k.encode()) for k in keys] == versions and all(versions)
        assert [again.ssd.size_of(k.encode()) for k in keys] == [4096] * len(keys)
        if source == "index":
            assert list(again.ssd._order) == order
        assert_serves(again, {k: payload(k, 4096) for k in keys})
        again.close()


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped body", "flipped header", "flipped count",
                                    "garbage", "empty"])
def test_a_missing_or_corrupt_index_falls_back_to_a_scan(make_cache: Callable[..., TieredCache], ssd_dir: str,
                                                         damage: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache)
    cache.close()
    path = index_file(ssd_dir)
    raw = bytearray(path.read_bytes())
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(raw[:len(raw) // 2])
    elif damage == "flipped body":
        raw[-1] ^= 0x01
        path.write_bytes(raw)
    elif damage == "flipped header":
        raw[9] ^= 0x01  # the saved transaction id
        path.write_bytes(raw)
    elif damage == "flipped count":
        raw[32 + 7] ^= 0x10  # the number of keys, far past the file's end
        path.write_bytes(raw)
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(raw)))
    else:
        path.write_bytes(b"")
    again = make_cache(ssd_path=ssd_dir)
    assert again.ssd is not None and again.ssd.opened_from == "scan"
    assert not path.exists()
    assert_serves(again, {k: payload(k, 3000) for k in KEYS})


def test_an_index_older_than_lmdb_is_not_used(make_cache: Callable[..., TieredCache], ssd_dir: str,
                                              tmp_path: Path) -> None:
    """An index from an earlier close, put back after later writes (as if a run that changed LMDB was
    killed before it could save its own): removed, replaced and new blocks are as LMDB says."""
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache)
    cache.close()
    old = tmp_path / "old-index"
    shutil.copy(index_file(ssd_dir), old)
    cache = make_cache(ssd_path=ssd_dir)
    cache.remove(KEYS[0])
    cache.put(KEYS[1], payload("replaced", 500))
    cache.put("new", payload("new", 700))
    cache.flush()
    cache.close()
    shutil.copy(old, index_file(ssd_dir))
    again = make_cache(ssd_path=ssd_dir)
    assert again.ssd is not None and again.ssd.opened_from == "scan"
    assert_serves(again, {KEYS[0]: None, KEYS[1]: payload("replaced", 500), "new": payload("new", 700),
                          **{k: payload(k, 3000) for k in KEYS[2:]}})


def test_no_index_is_saved_when_another_writer_changed_lmdb(make_cache: Callable[..., TieredCache],
                                                           ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache)
    assert cache.ssd is not None
    data = payload("theirs", 900)
    with cache.ssd.store.env.begin(write=True) as txn:  # another process's write, as the cache never sees it
        txn.put(b"theirs", encode_header(BlockMeta(900, checksum(data))) + data)
    cache.close()
    assert not index_file(ssd_dir).exists()
    again = make_cache(ssd_path=ssd_dir)
    assert again.ssd is not None and again.ssd.opened_from == "scan"
    assert_serves(again, {"theirs": data, **{k: payload(k, 3000) for k in KEYS}})


def test_removed_blocks_stay_removed_whichever_way_the_tier_reopens(make_cache: Callable[..., TieredCache],
                                                                     ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache)
    assert cache.batch_remove(KEYS[:5]) == [True] * 5
    cache.close()
    want: dict[str, bytes | None] = {**dict.fromkeys(KEYS[:5]), **{k: payload(k, 3000) for k in KEYS[5:]}}
    for source in ("index", "scan"):
        if source == "scan":
            index_file(ssd_dir).unlink()
        again = make_cache(ssd_path=ssd_dir)
        assert again.ssd is not None and again.ssd.opened_from == source
        assert again.prefix_match(KEYS) == 0 and again.prefix_match(KEYS[5:]) == len(KEYS) - 5
        assert_serves(again, want)
        again.close()


@pytest.mark.parametrize("source", ["index", "scan"])
def test_expired_blocks_stay_expired_whichever_way_the_tier_reopens(make_cache: Callable[..., TieredCache],
                                                                     ssd_dir: str, source: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    cache.batch_put(["short", "long"], [payload("short", 100), payload("long", 100)], ttl_s=0.3)
    cache.put("forever", payload("forever", 100))
    cache.flush()
    cache.close()
    time.sleep(0.4)
    if source == "scan":
        index_file(ssd_dir).unlink()
    again = make_cache(ssd_path=ssd_dir)
    assert again.ssd is not None and again.ssd.opened_from == source and len(again.ssd) == 3
    assert again.prefix_match(["forever", "short"]) == 1
    assert again.batch_exists(["short", "forever", "long"]) == [False, True, False]
    assert_serves(again, {"short": None, "long": None, "forever": payload("forever", 100)})
    again.close()
    assert make_cache(ssd_path=ssd_dir).get("short") is None  # dropped for good, not back after a close


def test_a_forged_index_that_passes_the_checks_serves_no_wrong_bytes(make_cache: Callable[..., TieredCache],
                                                                      ssd_dir: str) -> None:
    """An index naming LMDB's current state but lying about it (wrong size, a lost expiry, a key LMDB
    does not hold in place of one it does): every read checks the stored header, so a lie is a miss."""
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache, KEYS[:4])
    cache.put("expired", payload("expired", 100), ttl_s=0.2)
    cache.flush()
    assert cache.ssd is not None
    versions = {k.encode(): cache.ssd.version_of(k.encode()) for k in KEYS[:4]}
    cache.close()
    index_file(ssd_dir).unlink()
    time.sleep(0.3)
    store = SsdStore(ssd_dir, map_size=256 * MiB, sync=False)
    try:
        # LMDB holds KEYS[:4] and "expired": as many entries as these keys and the one "stale"; the
        # index tells the truth about KEYS[0] only (KEYS[1]: its size; "expired": its expiry; a version
        # the index gets wrong is a lie too: a promotion keeps a block only if the SSD still holds the
        # version it read)
        sizes = {KEYS[0].encode(): 3000, KEYS[1].encode(): 2999, b"expired": 100, b"ghost": 3000}
        truth = {KEYS[0].encode(): versions[KEYS[0].encode()], KEYS[1].encode(): versions[KEYS[1].encode()]}
        assert ssd_index.save(store, ssd_index.Snapshot(sizes, {}, [KEYS[2].encode()], truth))
    finally:
        store.close()
    again = make_cache(ssd_path=ssd_dir, ssd_map_size=256 * MiB)
    assert again.ssd is not None and again.ssd.opened_from == "index"  # it fooled the checks
    assert again.get(KEYS[0]) == payload(KEYS[0], 3000)
    for k in (KEYS[1], "expired", "ghost", KEYS[2], KEYS[3]):  # KEYS[3]: held by LMDB, unknown to the index
        assert again.get(k) is None, k
    assert again.batch_exists([KEYS[1], "expired", "ghost"]) == [False, False, False]


def test_copies_waiting_for_deletion_at_close_are_deleted_after_the_reopen(tmp_path: Path) -> None:
    """A removal whose LMDB delete could not run before the close (a full disk) is saved as pending and
    done after the reopen: the block does not come back."""
    path = tmp_path / "lmdb"
    store = SsdStore(path, map_size=64 * MiB, sync=False)
    data = payload("gone", 2000)
    store.batch_put([(b"gone", BlockMeta(2000, checksum(data)), memoryview(data)),
                     (b"kept", BlockMeta(2000, checksum(data)), memoryview(data))])
    tier = SsdTier(store, "lru")
    tier.forget(b"gone")
    tier.mark_stale([b"gone"])  # not deleted yet
    tier.close()
    store = SsdStore(path, map_size=64 * MiB, sync=False)
    tier = SsdTier(store, "lru")
    try:
        assert tier.opened_from == "index" and b"gone" not in tier and b"kept" in tier and tier.has_stale
        assert tier.delete_stale() and not store.contains(b"gone") and store.contains(b"kept")
    finally:
        tier.close()


def test_a_killed_run_after_an_indexed_reopen_leaves_no_index_to_trust(make_cache: Callable[..., TieredCache],
                                                                        ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache)
    cache.close()
    pid = os.fork()
    if pid == 0:  # a run that reopens from the index, changes LMDB and is killed before its close
        child = TieredCache(ssd_path=ssd_dir, dram_bytes=32 * MiB, dram_slab_size=1 * MiB, prefault=False)
        child.remove(KEYS[0])
        child.put("late", payload("late", 800))
        child.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    again = make_cache(ssd_path=ssd_dir)
    assert again.ssd is not None and again.ssd.opened_from == "scan"
    assert_serves(again, {KEYS[0]: None, "late": payload("late", 800), **{k: payload(k, 3000) for k in KEYS[1:]}})


def test_a_scan_drops_values_whose_header_disagrees_with_their_length(tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    store = SsdStore(path, map_size=64 * MiB, sync=False)
    data = payload("x", 1000)
    store.batch_put([(b"good", BlockMeta(1000, checksum(data)), memoryview(data))])
    with store.env.begin(write=True) as txn:
        txn.put(b"short", encode_header(BlockMeta(1000, checksum(data))) + data[:10])
        txn.put(b"tiny", b"KVB1")
    tier = SsdTier(store, "lru")
    try:
        assert tier.opened_from == "scan" and list(tier) == [b"good"] and store.corrupt == 2
        assert not store.contains(b"short") and not store.contains(b"tiny")
    finally:
        tier.close()


def test_the_index_file_is_private(make_cache: Callable[..., TieredCache], ssd_dir: str) -> None:
    cache = make_cache(ssd_path=ssd_dir)
    fill(cache, KEYS[:2])
    cache.close()
    assert index_file(ssd_dir).stat().st_mode & 0o077 == 0


def test_lmdb_last_txnid_advances_with_every_commit(tmp_path: Path) -> None:
    """The stamp the index relies on: LMDB's last transaction id moves on every committed write."""
    env = lmdb.open(str(tmp_path / "e"), map_size=16 * MiB)
    try:
        before = env.info()["last_txnid"]
        with env.begin(write=True) as txn:
            txn.put(b"a", b"1")
        with env.begin(write=True) as txn:
            txn.delete(b"a")
        assert env.info()["last_txnid"] == before + 2
    finally:
        env.close()


def test_a_checksummed_index_with_impossible_counts_is_refused(tmp_path: Path) -> None:
    """Counts that the checksum vouches for but the body cannot hold (a writer's bug, not bit rot)."""
    store = SsdStore(tmp_path / "lmdb", map_size=16 * MiB, sync=False)
    try:
        txnid, entries, inode = ssd_index._stamp(store)
        body = b"\x00" * 8
        fields = (ssd_index._MAGIC, txnid, entries, inode, 1 << 40, 0, len(body))
        raw = ssd_index._HEAD.pack(*fields, ssd_index._digest(ssd_index._HEAD.pack(*fields, 0), body)) + body
        (tmp_path / "lmdb" / ssd_index.FILE_NAME).write_bytes(raw)
        assert ssd_index.load(store) is None
        assert not (tmp_path / "lmdb" / ssd_index.FILE_NAME).exists()
    finally:
        store.close()
