"""What the SSD tier knows of its blocks without reading them, rebuilt at open from a file persisted
beside LMDB (one read, in eviction order) or else from a scan of every block's header.

The file is written at a clean close and consumed (unlinked) at the next open. It is trusted only if
its checksum holds and it names the LMDB state it was taken from: the environment's last transaction
id (which every committed write advances), its entry count and its data file. Even a wrong index
cannot serve wrong bytes or expired blocks: every read checks the stored header's size, expiry and
checksum (`tier_moves.promote`), and a disagreeing block is dropped as a miss.
"""
from __future__ import annotations

import itertools
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np
import xxhash

from ..blocks import HEADER_SIZE, MAGIC, READABLE, header_check
from ..errors import CapacityError
from ..keys import MAX_KEY_BYTES
from .ssd import SsdStore

__all__ = ["FILE_NAME", "Snapshot", "last_txnid", "load", "save", "scan"]

log = logging.getLogger("kvpool.ssd")

FILE_NAME = "kvpool-index"
"""The index file's name inside the SSD tier's directory."""

_MAGIC = b"KVPIDX02"  # 02: blocks' versions
_HEAD = struct.Struct("<8sQQQQQQQ")  # magic, last txnid, entries, data file inode, keys, stale keys, body bytes, xxh3
_BLOCK_HEADER = np.dtype([("magic", "S4"), ("version", "<u2"), ("flags", "<u2"), ("size", "<u8"),  # flags: the check
                          ("checksum", "<u8"), ("expires", "<f8"),
                          ("block_version", "<u8")])  # blocks._HEADER, for a vectorised decode


@dataclass
class Snapshot:
    """The SSD tier's index: payload `sizes` (bytes) of the indexed keys, in eviction order (first to
    go first), `expires` (unix seconds) of those that have a TTL, their blocks' `versions`, and `stale`
    keys whose stored copies wait to be deleted. `source` says where it came from ("index" or "scan")."""

    sizes: dict[bytes, int] = field(default_factory=dict)
    expires: dict[bytes, float] = field(default_factory=dict)
    stale: list[bytes] = field(default_factory=list)
    versions: dict[bytes, int] = field(default_factory=dict)
    source: str = "scan"


def _path(store: SsdStore) -> Path:
    return store.path / FILE_NAME


def _stamp(store: SsdStore) -> tuple[int, int, int]:
    """(last transaction id, entries, data file inode) of the environment as of now."""
    env = store.env
    return int(env.info()["last_txnid"]), int(env.stat()["entries"]), os.stat(store.data_file()).st_ino


def last_txnid(store: SsdStore) -> int:
    """LMDB's last committed transaction id: every write the environment commits advances it."""
    return int(store.env.info()["last_txnid"])


def save(store: SsdStore, snap: Snapshot) -> bool:
    """Write `snap` beside `store` (durably, then renamed into place); False, with a log line, if the
    disk refused. Call it only when `snap` is exactly what LMDB holds."""
    path = _path(store)
    tmp = path.with_name(FILE_NAME + ".tmp")
    try:
        store.env.sync(True)  # the index must never name a state LMDB could still lose
        txnid, entries, inode = _stamp(store)
        every = [*snap.sizes, *snap.stale]
        n = len(snap.sizes)
        lengths = np.fromiter(map(len, every), dtype="<u2", count=len(every))
        sizes = np.fromiter(snap.sizes.values(), dtype="<u8", count=n)
        expires = np.fromiter(map(snap.expires.get, snap.sizes, itertools.repeat(0.0)), dtype="<f8", count=n)
        versions = np.fromiter(map(snap.versions.get, snap.sizes, itertools.repeat(0)), dtype="<u8", count=n)
        body = b"".join((lengths.tobytes(), sizes.tobytes(), expires.tobytes(), versions.tobytes(), *every))
        fields = (_MAGIC, txnid, entries, inode, n, len(snap.stale), len(body))
        head = _HEAD.pack(*fields, _digest(_HEAD.pack(*fields, 0), body))
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(head)
                f.write(body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except (OSError, lmdb.Error) as e:
        log.warning("SSD tier at %s: index not saved (%s); the next open scans every block", store.path, e)
        tmp.unlink(missing_ok=True)
        return False
    return True


def load(store: SsdStore) -> Snapshot | None:
    """The persisted index if it matches LMDB's state (else None, with a log line saying why). The file
    is consumed: it is unlinked whether or not it was used, so it is never trusted twice."""
    path = _path(store)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("SSD tier at %s: cannot read its index (%s); scanning", store.path, e)
        return None
    try:
        path.unlink()
    except OSError as e:
        log.warning("SSD tier at %s: cannot remove its index (%s); scanning", store.path, e)
        return None
    why = _mismatch(store, raw)
    if why is None:
        snap = _parse(raw)
        if snap is not None:
            return snap
        why = "its contents are inconsistent"
    log.info("SSD tier at %s: index not used (%s); scanning", store.path, why)
    return None


def _mismatch(store: SsdStore, raw: bytes) -> str | None:
    if len(raw) < _HEAD.size:
        return f"{len(raw)} bytes, shorter than its header"
    magic, txnid, entries, inode, _n, _stale, body_len, digest = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        return f"bad magic {magic!r}"
    fields = _HEAD.unpack_from(raw)[:-1]
    if len(raw) - _HEAD.size != body_len or _digest(_HEAD.pack(*fields, 0), memoryview(raw)[_HEAD.size:]) != digest:
        return "checksum mismatch"
    now = _stamp(store)
    if now != (txnid, entries, inode):
        return f"it describes LMDB at transaction {txnid} with {entries} entries; LMDB is at {now[0]} with {now[1]}"
    return None


def _digest(head: bytes, body: bytes | memoryview) -> int:
    """XXH3-64 of the header (its digest field zero) and the body: no field goes unchecked."""
    h = xxhash.xxh3_64(head)
    h.update(body)
    return h.intdigest()


def _parse(raw: bytes) -> Snapshot | None:
    """The snapshot in a checksummed, stamp-matching file, or None if its fields disagree."""
    _, _, entries, _, n, n_stale, body_len, _ = _HEAD.unpack_from(raw)
    total = n + n_stale
    if 2 * total + 24 * n > body_len:
        return None
    off = _HEAD.size
    lengths = np.frombuffer(raw, dtype="<u2", count=total, offset=off)
    off += 2 * total
    sizes = np.frombuffer(raw, dtype="<u8", count=n, offset=off)
    off += 8 * n
    expires = np.frombuffer(raw, dtype="<f8", count=n, offset=off)
    off += 8 * n
    versions = np.frombuffer(raw, dtype="<u8", count=n, offset=off)
    off += 8 * n
    if total and (int(lengths.min()) < 1 or int(lengths.max()) > MAX_KEY_BYTES):
        return None
    if int(lengths.sum(dtype=np.int64)) != len(raw) - off:
        return None
    every = _split(raw, off, lengths)
    keys, stale = every[:n], every[n:]
    by_version = dict(zip(keys, versions.tolist()))  # (each key hashed here, once)
    if len(by_version) != n or n + len(set(stale).difference(by_version)) != entries:
        return None  # duplicates, or keys LMDB does not hold (or holds more of)
    if n and (sizes == sizes[0]).all():  # blocks of one size (the usual tier): one int for all, and the
        by_key = dict.fromkeys(by_version, int(sizes[0]))  # table made at its size from the first one's
    else:
        by_key = dict(zip(keys, sizes.tolist()))
    timed = np.flatnonzero(expires).tolist()
    return Snapshot(by_key, dict(zip([keys[i] for i in timed], expires[timed].tolist())),
                    stale, by_version, source="index")


def _split(raw: bytes, off: int, lengths: np.ndarray) -> list[bytes]:
    """`raw[off:]` cut into keys of `lengths` bytes (which add up to its length)."""
    if not len(lengths):
        return []
    width = int(lengths[0])
    if (lengths == width).all():
        cells = np.frombuffer(raw, dtype=np.uint8, offset=off).reshape(-1, width)
        if cells[:, -1].all():  # fixed-width bytes strip trailing NULs: only without them
            return list(np.frombuffer(raw, dtype=f"S{width}", offset=off).tolist())
    ends = np.cumsum(lengths, dtype=np.int64) + off
    return [raw[a:b] for a, b in zip((ends - lengths).tolist(), ends.tolist())]


def scan(store: SsdStore) -> Snapshot:
    """The index rebuilt from every block's header, in key order. A value whose header is corrupt or
    whose length disagrees with it is counted in `store.corrupt` and deleted (if the disk lets us)."""
    keys: list[bytes] = []
    lens: list[int] = []
    heads = bytearray()
    bad: list[bytes] = []
    with store.env.begin(buffers=True) as txn:
        for k, v in txn.cursor():
            if len(v) < HEADER_SIZE:
                bad.append(bytes(k))
                continue
            keys.append(bytes(k))
            lens.append(len(v))
            heads += v[:HEADER_SIZE]
    h = np.frombuffer(heads, dtype=_BLOCK_HEADER)
    checked = h["version"] >= 3
    with np.errstate(over="ignore"):  # (the check's products wrap around 2**64, as meant)
        check = header_check(h["size"], h["checksum"], h["expires"].view("<u8"), h["block_version"])
    ok = (h["magic"] == MAGIC) & np.isin(h["version"], READABLE) & \
        (h["size"] == np.asarray(lens, dtype=np.int64) - HEADER_SIZE) & (h["flags"] == np.where(checked, check, 0))
    if not ok.all():
        bad += [k for k, good in zip(keys, ok.tolist()) if not good]
        keys = [k for k, good in zip(keys, ok.tolist()) if good]
        h = h[ok]
    if bad:
        store.corrupt += len(bad)
        try:
            store.delete(bad)
        except CapacityError as e:
            log.warning("SSD tier at %s: %d corrupt blocks not deleted (%s); they stay misses", store.path,
                        len(bad), e)
    timed = np.flatnonzero(h["expires"]).tolist()
    return Snapshot(dict(zip(keys, h["size"].tolist())),
                    dict(zip([keys[i] for i in timed], h["expires"][timed].tolist())),
                    versions=dict(zip(keys, h["block_version"].tolist())))
