"""The worker wire protocol: framed, versioned, batched, checksummed; the same over TCP and Unix sockets.

A frame is a 32-byte header, `meta_len` bytes of metadata, then `data_len` bytes of block data:

    magic "KVPW" | version u8 | op u8 | status u16 | request id u32 | meta_len u32 | data_len u64 |
    meta checksum u32 (xxh32) | reserved u32

Batch metadata is binary (`pack_batch`): the keys, then fixed-width columns (sizes, checksums,
offsets...) as little-endian arrays. Control messages (hello, auth, stats) carry JSON metadata.
Block data is each block's bytes back to back; the receiver `recv_into`s them straight into their
destination (an arena slot, the caller's buffer) and checks every block's XXH3-64.
"""
from __future__ import annotations

import json
import socket
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from itertools import accumulate
from typing import Any

import numpy as np
import xxhash

from .errors import PoolUnavailable, ProtocolError
from .keys import MAX_KEY_BYTES
from .request_ids import check as check_id
from .request_ids import issue as issue_id
from .versions import CLEAR, PUT, REMOVE, REMOVED, SUPERSEDED, Change

__all__ = ["MAGIC", "VERSION", "HEADER", "MAX_META", "MAX_DATA", "MAX_BATCH", "Op", "ONE_WAY", "Status", "ITEM_QUOTA",
    "ITEM_SUPERSEDED", "REMOVED", "SUPERSEDED", "Frame",
    "header", "recv_exactly", "recv_checksum", "recv_into_all", "recv_frame", "send_frame", "pack_json", "unpack_json",
    "frames", "pack_batch", "unpack_batch", "unpack_ids", "check_reply", "recv_reply", "recv_blocks", "drain",
    "DRAIN_CHUNK", "CLEAR_KEY_MARK", "pack_changes", "unpack_changes"]

MAGIC = b"KVPW"
VERSION = 6
"""2: HELLO/AUTH are a challenge-response in both directions (the token never crosses the wire).
3: blocks carry versions (`kvpool.core.versions`): PUT, COMMIT and REMOVE send a versions column;
GET, LEASE and EXISTS return one; CHANGES lists a worker's recent changes for a returning peer.
4: a put or remove no newer than what the worker holds is told (ITEM_SUPERSEDED, SUPERSEDED), not
answered as done.
5: CHANGES tells clears (`pack_changes`).
6: SUPERSEDE tells a key's worker next in line of a put or remove at its owners."""
HEADER = struct.Struct("<4sBBHIIQII")
MAX_META = 16 << 20
MAX_DATA = 8 << 30
MAX_BATCH = 1 << 16
_META_STEP = 1 << 20
_IOV_MAX = 512
"""Buffers per scatter-gather system call (Linux allows 1024)."""
_HASH_CHUNK = 256 << 10
"""`recv_checksum` hashes a large block this many bytes at a time, as each part lands."""

CLEAR_KEY_MARK = b"*"
"""Before a clear's prefix in a CHANGES reply (keys there are never empty; a prefix may be)."""


class Op(IntEnum):
    HELLO = 1     # -> json: before auth {"auth": true, "nonce"} only; after (or unneeded) the worker's description
    AUTH = 2      # json {"nonce", "proof"} (client's) -> json: the worker's description and {"proof"} (worker's)
    PUT = 3       # keys + sizes, checksums, versions; data -> statuses (ITEM_SUPERSEDED: not stored, a version as
    #               new or newer is held)
    GET = 4       # keys -> sizes, checksums, versions (a miss: its tombstone's, or 0); data
    EXISTS = 5    # keys -> flags, versions (as GET's)
    PREFIX = 6    # keys -> status-free json {"n"}
    REMOVE = 7    # keys + versions -> flags (REMOVED, or SUPERSEDED: a block as new or newer is held); each
    #               removal leaves a tombstone
    CLEAR = 8     # -> status
    STATS = 9     # -> json
    ALLOC = 10    # same node: keys + sizes -> offsets (-1: no room)
    COMMIT = 11   # same node: keys + offsets + sizes + checksums + versions -> statuses (ITEM_CORRUPT: bytes do
    #               not match; ITEM_SUPERSEDED as PUT's)
    ABORT = 12    # same node: raw offsets -> (no reply)
    LEASE = 13    # same node: keys -> lease ids, offsets, sizes, checksums, versions
    RELEASE = 14  # same node: raw lease ids -> (no reply)
    PIN = 15      # keys + seconds f8 (<= 0: unpin) -> (no reply); a put that follows it commits pinned
    CHANGES = 16  # json {"since_ms", "from_seq"} -> covered_since_ms u64, next_seq i64 (-1: done), then keys +
    #               versions u8, kinds u1 (0 a put, 1 a removal, 2 a clear: its key is CLEAR_KEY_MARK + the
    #               prefix cleared): the changes the worker accepted since then (`kvpool.core.catch_up`)
    COMMIT_UNCHECKED = 17  # same node: as COMMIT, but the worker takes the checksums on the writer's word for
    #                        now and hashes each block at its first read (a handoff's reader checks its own copy)
    SUPERSEDE = 18  # keys + versions -> (no reply): the key's owners took a put or remove as of the version; a
    #                 block held stamped before it (or within the clock skew after) goes (`ReplicaState.supersede`)


ONE_WAY = frozenset({Op.ABORT, Op.RELEASE, Op.PIN, Op.SUPERSEDE})
"""Requests the worker never answers."""


class Status(IntEnum):
    OK = 0
    ERROR = 1
    AUTH_REQUIRED = 2
    AUTH_FAILED = 3
    BAD_REQUEST = 4
    FORBIDDEN = 5  # a tenant's request names a key outside its namespace: NamespaceError
    BUSY = 6  # the worker has no room for this connection now (a tenant past its share): PoolUnavailable
    STORAGE = 7  # the change took effect but is not durable (a full disk kept older SSD copies): StorageError


ITEM_QUOTA = -5
"""A put's per-block status: the tenant's quota has no room for it (QuotaExceeded)."""
ITEM_SUPERSEDED = -6
"""A put's per-block status: not stored, the worker holds a version of the key as new or newer (a block
or a removal). Not an error: a writer that stamped the block itself stamps it again above that version
(another writer's clock may run ahead of its own, or have stamped in the same millisecond)."""


ITEM_STORAGE = -7
"""A put's per-block status: stored, but not durable: a full disk kept the older SSD copy the block
replaces, which a crash would bring back (StorageError)."""
ITEM_OK, ITEM_MISS, ITEM_CORRUPT, ITEM_FULL, ITEM_TOO_LARGE = 0, -1, -2, -3, -4


@dataclass
class Frame:
    op: int
    status: int
    req_id: int
    meta: bytes
    data_len: int


def header(op: int, status: int, req_id: int, meta: bytes, data_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, status, req_id, len(meta), data_len,
                       xxhash.xxh32_intdigest(meta), 0)


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; a closed connection raises ConnectionError."""
    got = 0
    n = len(view)
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL  # blocking: one system call for all
    while got < n:
        k = sock.recv_into(view[got:], n - got, flags)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_checksum(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock` and return the XXH3-64 of what landed (`kvpool.core.blocks.checksum`),
    hashed chunk by chunk as it arrives, while each chunk is still in cache."""
    if len(view) <= _HASH_CHUNK:
        recv_exactly(sock, view)
        return xxhash.xxh3_64_intdigest(view)
    h = xxhash.xxh3_64()
    for start in range(0, len(view), _HASH_CHUNK):
        chunk = view[start:start + _HASH_CHUNK]
        recv_exactly(sock, chunk)
        h.update(chunk)
    return h.intdigest()


def recv_into_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill each of `views` in turn from `sock`: a scatter receive fills many per system call (over
    TLS, which has none, one after another). A closed connection raises ConnectionError."""
    if isinstance(sock, ssl.SSLSocket) or len(views) == 1:
        for v in views:
            recv_exactly(sock, v)
        return
    pending = [v for v in views if len(v)]
    i = 0
    while i < len(pending):
        k = sock.recvmsg_into(pending[i:i + _IOV_MAX])[0]
        if k == 0:
            raise ConnectionError(f"connection closed with {sum(map(len, pending[i:]))} bytes to come")
        while k:
            n = len(pending[i])
            if k < n:
                pending[i] = pending[i][k:]
                break
            k -= n
            i += 1


def recv_frame(sock: socket.socket, max_meta: int = MAX_META, head: bytearray | None = None) -> Frame:
    """Read one header and its metadata (the data, if any, is left for the caller to receive);
    `max_meta` (bytes) lowers the metadata limit (a peer that has not authenticated yet); `head`:
    the header, already received by the caller."""
    raw = head if head is not None else bytearray(HEADER.size)
    if head is None:
        spin = getattr(sock, "spin", None)  # a client's socket that spins for answers: kvpool.core.reply_spin
        if spin is not None:
            spin.wait(sock)
        recv_exactly(sock, memoryview(raw))
    magic, version, op, status, req_id, meta_len, data_len, meta_crc, _ = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}; this side speaks {VERSION}")
    if meta_len > max_meta or data_len > MAX_DATA:
        big, limit = (meta_len, max_meta) if meta_len > max_meta else (data_len, MAX_DATA)
        raise ProtocolError(f"frame of {meta_len} meta / {data_len} data bytes exceeds {max_meta} / {MAX_DATA}",
                            size=big, limit=limit)
    meta = _recv_meta(sock, meta_len)
    if xxhash.xxh32_intdigest(meta) != meta_crc:
        raise ProtocolError("metadata checksum mismatch")
    return Frame(op, status, req_id, meta, data_len)


def _py_split_keys(meta: bytes, n: int, pos: int, max_key: int) -> tuple[list[bytes], int] | tuple[None, int]:
    """The `n` keys of a batch whose u16 lengths start at `pos` in `meta`, and the position after the last
    key; (None, length) for the first length outside 1..`max_key`; ValueError (numpy's) or ProtocolError
    where `meta` ends first.
    (`_native.split_keys`, in one pass, where the extension was built.)"""
    lens = np.frombuffer(meta, dtype="<u2", count=n, offset=pos)
    pos += 2 * n
    sizes = lens.tolist()
    if sizes and (min(sizes) == 0 or max(sizes) > max_key):
        return None, next(ln for ln in sizes if not 0 < ln <= max_key)
    if sizes and min(sizes) == max(sizes):  # keys of one length (the usual batch): numpy cuts them
        return np.frombuffer(meta, dtype=f"V{sizes[0]}", count=n, offset=pos).tolist(), pos + n * sizes[0]
    ends = list(accumulate(sizes, initial=pos))  # each key's start, then the end of the last
    if ends[-1] > len(meta):
        raise ProtocolError(f"truncated batch metadata ({len(meta)} bytes): the keys run past its end")
    return [bytes(meta[a:b]) for a, b in zip(ends, ends[1:])], ends[-1]


try:
    from ._native import split_keys as _split_keys
except ImportError:  # no C compiler when it was installed
    _split_keys = _py_split_keys


def _recv_meta(sock: socket.socket, n: int) -> bytes:
    """`n` bytes, buffered in steps as they arrive: memory follows what a peer sends, not what its
    header claims (16 MiB per connection before authentication, otherwise)."""
    if n <= _META_STEP and not isinstance(sock, ssl.SSLSocket):  # the usual case: one receive, no copy
        meta = sock.recv(n, socket.MSG_WAITALL)
        if len(meta) == n:
            return meta
        if not meta:
            raise ConnectionError(f"connection closed after 0 of {n} bytes")
        rest = bytearray(n - len(meta))
        recv_exactly(sock, memoryview(rest))
        return meta + rest
    parts = []
    while n:
        part = bytearray(min(n, _META_STEP))
        recv_exactly(sock, memoryview(part))
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def send_frame(sock: socket.socket, op: int, meta: bytes = b"", *, status: int = 0, req_id: int | None = None,
               data: list[memoryview] | None = None) -> None:
    """Send header, metadata and data buffers with as few system calls as the kernel allows. A client's
    request takes the connection's next id (`request_ids`); the worker's reply passes its request's."""
    data = data or []
    rid = issue_id(sock, op not in ONE_WAY) if req_id is None else req_id
    _send_all(sock, [header(op, status, rid, meta, sum(len(d) for d in data)), meta, *data])


def send_frames(sock: socket.socket, frames: Sequence[tuple[int, bytes]]) -> None:
    """Send requests of (op, metadata) and no data back to back, in one system call where the kernel
    takes them whole: the peer reads them in one wake-up rather than one each."""
    bufs: list[Any] = []
    for op, meta in frames:
        bufs += [header(op, 0, issue_id(sock, op not in ONE_WAY), meta, 0), meta]
    _send_all(sock, bufs)


_TLS_JOIN = 64 << 10
"""Buffers under this many bytes are joined into one TLS write (a record each would cost more)."""


def _send_all(sock: socket.socket, bufs: list[Any]) -> None:
    if isinstance(sock, ssl.SSLSocket):  # TLS (kvpool.core.tls) has no scatter-gather send: headers and
        small = bytearray()             # metadata go joined, a block's data on its own
        for b in bufs:
            if len(b) < _TLS_JOIN:
                small += b
                continue
            if small:
                sock.sendall(small)
                small = bytearray()
            sock.sendall(b)
        if small:
            sock.sendall(small)
        return
    while bufs:
        sent = sock.sendmsg(bufs[:512])
        while sent and bufs:
            n = len(bufs[0])
            if sent >= n:
                sent -= n
                bufs.pop(0)
            else:
                bufs[0] = memoryview(bufs[0])[sent:]
                sent = 0
        while bufs and len(bufs[0]) == 0:
            bufs.pop(0)


def pack_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(meta: bytes) -> dict[str, Any]:
    """A JSON object; anything else (bad JSON, a list, nesting too deep to parse) is a ProtocolError."""
    try:
        obj = json.loads(meta) if meta else {}
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"bad JSON metadata: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"JSON metadata is a {type(obj).__name__}; expected an object")
    return obj


_ITEM_META = 2 + MAX_KEY_BYTES + 8 * 5
"""The most metadata one batch item takes: key length, key, and up to five 8-byte columns."""
_SAFE_BATCH = min(MAX_BATCH, (MAX_META - 4) // _ITEM_META)


def frames(n: int, sizes: Sequence[int] | None = None, max_bytes: int = MAX_DATA, per_item: int = 0) -> list[slice]:
    """Slices of a batch of `n` items such that each fits one frame: at most MAX_BATCH items, their
    metadata within MAX_META whatever their keys, and (given the items' data `sizes`, each counted
    `per_item` bytes more: `RESERVE_FLOOR` for a worker's reservation budget) their data within
    `max_bytes` (MAX_DATA; an item larger than that goes alone). Almost every batch is one slice; a
    client splits bigger ones rather than have a healthy worker refuse them. No slice for no items (no
    request: an empty one was a round trip for nothing)."""
    if n == 0:
        return []
    if n <= _SAFE_BATCH and (sizes is None or sum(sizes) + per_item * n <= max_bytes):
        return [slice(0, n)]
    out: list[slice] = []
    start, data = 0, 0
    for i in range(n):
        size = per_item + (0 if sizes is None else int(sizes[i]))
        if i > start and (i - start >= _SAFE_BATCH or data + size > max_bytes):
            out.append(slice(start, i))
            start, data = i, 0
        data += size
    out.append(slice(start, n))
    return out


def pack_batch(keys: list[bytes], *columns: np.ndarray) -> bytes:
    """Keys (count, u16 lengths, bytes) followed by each column's raw little-endian bytes."""
    lens = np.fromiter(map(len, keys), dtype="<u2", count=len(keys))
    parts = [struct.pack("<I", len(keys)), lens.tobytes(), b"".join(keys)]
    parts.extend(np.ascontiguousarray(c).tobytes() for c in columns)
    return b"".join(parts)


def unpack_batch(meta: bytes, *dtypes: str) -> tuple[list[bytes], list[np.ndarray]]:
    """Inverse of `pack_batch` given the column dtypes; raises ProtocolError on any inconsistency."""
    try:
        (n,) = struct.unpack_from("<I", meta)
        if n > MAX_BATCH:
            raise ProtocolError(f"batch of {n} items exceeds {MAX_BATCH}", size=n, limit=MAX_BATCH)
        keys, pos = _split_keys(meta, n, 4, MAX_KEY_BYTES)
        if keys is None:  # (pos: the first length out of range)
            raise ProtocolError(f"key of {pos} bytes in batch; keys are 1 to {MAX_KEY_BYTES} bytes", size=pos,
                                limit=MAX_KEY_BYTES)
        cols = []
        for dt in dtypes:
            col = np.frombuffer(meta, dtype=dt, count=n, offset=pos)
            pos += col.nbytes
            cols.append(col)
    except (struct.error, ValueError) as e:
        raise ProtocolError(f"truncated batch metadata ({len(meta)} bytes): {e}") from e
    if pos != len(meta):  # (keys cut short by the end of `meta` leave pos past it)
        raise ProtocolError(f"batch metadata is {len(meta)} bytes; its fields account for {pos}")
    return keys, cols


def unpack_ids(meta: bytes) -> np.ndarray:
    """A bare little-endian int64 array (ABORT offsets, RELEASE lease ids)."""
    if len(meta) % 8 or len(meta) > 8 * MAX_BATCH:
        raise ProtocolError(f"id list of {len(meta)} bytes is not a whole number of int64 (max {MAX_BATCH})",
                            size=len(meta), limit=8 * MAX_BATCH)
    return np.frombuffer(meta, dtype="<i8")


def recv_reply(sock: socket.socket, op: int) -> Frame:
    """The next frame, checked as the worker's answer to the oldest request on `sock` owed one (its id:
    `request_ids`), of `op` (`check_reply`)."""
    reply = recv_frame(sock)
    check_id(sock, reply.req_id)
    check_reply(reply, op)
    return reply


def check_reply(frame: Frame, op: int) -> None:
    if frame.op != op:
        raise PoolUnavailable(f"worker answered op {frame.op} to op {op}")
    if frame.status == Status.AUTH_REQUIRED or frame.status == Status.AUTH_FAILED:
        from .errors import AuthError

        raise AuthError(unpack_json(frame.meta).get("error", "authentication required"))
    if frame.status == Status.BUSY:
        raise PoolUnavailable(unpack_json(frame.meta).get("error", "the worker is busy"))
    if frame.status == Status.STORAGE:
        from .errors import StorageError

        raise StorageError(unpack_json(frame.meta).get("error", "the worker's SSD tier refused the change"))
    if frame.status == Status.FORBIDDEN:
        from .errors import NamespaceError

        meta = unpack_json(frame.meta)
        raise NamespaceError(meta.get("error", "outside this token's namespace"), key=meta.get("key"))
    if frame.status != Status.OK:
        raise ProtocolError(unpack_json(frame.meta).get("error", f"worker error status {frame.status}"))


checksum = xxhash.xxh3_64_intdigest
"""A block's checksum (as `kvpool.core.blocks.checksum`) for what arrives in groups."""
RESERVE_FLOOR = 256
"""What a same-node reservation (ALLOC) of a block is charged against the connection's `max_reserve`
beyond its size: the arena's smallest slot (a 0-byte block takes one too; a larger one at most a quarter
more than its size, in its size class)."""
MAX_LEASES = 4 * MAX_BATCH
"""Leases one same-node connection may hold at once (each an entry in the worker's memory until its
RELEASE or the connection's end): the worker refuses a LEASE past it; a client's `batch_lease` of more
keys serves the rest as copies."""

_GROUP_BYTES = 512 << 10
"""Small blocks are received up to this many bytes at a time (one scatter receive), then hashed while
they are still in cache; a larger block is hashed chunk by chunk as it lands."""
DRAIN_CHUNK = 1 << 20
"""What `drain` reads at a time."""


def recv_blocks(sock: socket.socket, parts: list[memoryview | int]) -> list[int | None]:
    """Receive a frame's blocks in order (a PUT's on the worker, a GET reply's on the client): each
    memoryview filled, with its XXH3-64 returned; each int that many bytes read and dropped (None)."""
    out: list[int | None] = []
    group: list[memoryview] = []  # what the next receive fills
    hashed: list[memoryview | None] = []  # per block of the group: its view, None if dropped
    size = 0
    scratch: memoryview | None = None

    def flush() -> None:
        nonlocal size
        if group:
            recv_into_all(sock, group)
            out.extend(None if v is None else checksum(v) for v in hashed)
            group.clear()
            hashed.clear()
            size = 0

    for part in parts:
        n = part if isinstance(part, int) else part.nbytes
        if n > _GROUP_BYTES:  # alone
            flush()
            if isinstance(part, int):
                scratch = scratch if scratch is not None else memoryview(bytearray(DRAIN_CHUNK))
                drain(sock, n, scratch)
                out.append(None)
            else:
                out.append(recv_checksum(sock, part))
            continue
        if size + n > _GROUP_BYTES:
            flush()
        if isinstance(part, int):
            scratch = scratch if scratch is not None else memoryview(bytearray(DRAIN_CHUNK))
            group.append(scratch[:n])  # dropped blocks of a group may share it: nobody reads it
            hashed.append(None)
        else:
            group.append(part)
            hashed.append(part)
        size += n
    flush()
    return out


def drain(sock: socket.socket, n: int, scratch: bytearray | memoryview | None = None) -> None:
    """Read `n` bytes from `sock` and drop them, through `scratch` (default: a buffer of its own)."""
    view = memoryview(scratch if scratch is not None else bytearray(min(n, DRAIN_CHUNK)))
    while n:
        k = min(n, len(view))
        recv_exactly(sock, view[:k])
        n -= k


def pack_changes(changes: Sequence[Change]) -> bytes:
    """The changes of a CHANGES reply, after its two header fields: keys, versions u8, kinds u1. A clear's
    key is its prefix (which may be empty) behind CLEAR_KEY_MARK; a clear of a prefix as long as a key
    can be covers that one key, and goes as its removal."""
    keys, kinds = [], []
    for c in changes:
        whole = c.kind == CLEAR and len(c.key) >= MAX_KEY_BYTES
        keys.append(c.key if c.kind != CLEAR or whole else CLEAR_KEY_MARK + c.key)
        kinds.append(REMOVE if whole else c.kind)
    return pack_batch(keys, np.array([c.version for c in changes], dtype="<u8"), np.array(kinds, dtype="<u1"))


def unpack_changes(meta: bytes) -> list[Change]:
    """Inverse of `pack_changes` (the time of each change is not sent: 0)."""
    keys, (versions, kinds) = unpack_batch(meta, "<u8", "<u1")
    return [Change(k[len(CLEAR_KEY_MARK):] if kind == CLEAR else k, v, kind if kind in (REMOVE, CLEAR) else PUT, 0)
            for k, v, kind in zip(keys, versions.tolist(), kinds.tolist())]
