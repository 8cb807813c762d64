"""Payloads by reference: put bytes into the pool in chunks, and fetch them back verified.

The producer writes a payload as blocks of at most `CHUNK_BYTES` (so any worker's max block fits) and
publishes only their keys, sizes and checksums, and where a same-node put committed them (`Ref.places`);
the consumer reads them straight into one buffer and checks every size and checksum, so a missing or
corrupt block is a `PayloadError`, never wrong bytes. A consumer on the producer's node copies each
placed block from its own read-only mapping of the worker's arena, with no round trip to the worker
(`kvpool.core.read_placed`); a block it cannot read there (another node, a slot since reused: its
checksum disagrees) it gets from the pool.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvpool.core import (
    BufferSizeError,
    Key,
    Place,
    PoolClient,
    Stagers,
    checksum,
    get_placed,
    keys_bytes,
    put_placed,
    read_placed,
    readable,
    readable_all,
)

from .envelope import Ref
from .errors import CorruptPayload, PayloadError

CHUNK_BYTES = 4 << 20
"""Largest block a by-reference payload is split into, in bytes."""
COMMITTING_S = 0.5
"""How long a reader asks again for a block its message names that the pool does not hold (yet)."""


def put_blocks(pool: PoolClient, keys: Sequence[Key], buffers: Sequence[Any], *, request: str = "",
               layer: int = -1, pin_s: float = 0.0, stagers: Stagers | None = None, hold: bool = False) -> Ref:
    """Store each buffer under its key (pinned for `pin_s` seconds if > 0); the reference to publish.
    With `stagers`, a put to a worker on this node returns without waiting for it (`Stager`); with
    `hold` too, its COMMIT waits for `stagers.send_held()` (the caller announces the blocks first)."""
    views = readable_all(buffers)
    sizes = [len(v) for v in views]
    names = keys_bytes(keys) if stagers is not None else []
    stager = stagers.for_keys(names, sizes) if stagers is not None else None
    if stager is not None:
        staged, sums = stager.put(names, views, pin_s, hold=hold)
        at: list[Place | None] = list(staged)
        return Ref(list(keys), sizes, sums, request, layer, places=at)
    places = put_placed(pool, list(keys), views, pin_s=pin_s)
    return Ref(list(keys), sizes, [checksum(v) for v in views], request, layer, places=places)


def put_payload(pool: PoolClient, key_prefix: str, data: Any, *, pin_s: float = 0.0) -> Ref:
    """Store `data` as blocks `key_prefix/0`, `key_prefix/1`, ... of at most CHUNK_BYTES each."""
    view = readable(data)
    chunks = [view[i:i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES)] or [view]
    return put_blocks(pool, [f"{key_prefix}/{i}" for i in range(len(chunks))], chunks, pin_s=pin_s)


def fetch(pool: PoolClient, ref: Ref, into: Any = None, *,
          what: str = "payload") -> tuple[memoryview, list[memoryview]]:
    """Read the blocks of `ref` into `into` (writable, at least `ref.total` bytes) or a new bytearray.

    Returns a view of the whole payload and one per block (consecutive in it). Raises PayloadError on a
    missing block or a size/checksum mismatch."""
    return fetch_many(pool, [ref], [into], [what])[0]


def _bytes_of(into: Any, what: str) -> memoryview:
    """`into` as one flat run of bytes; PayloadError if it is not one (not a buffer, not contiguous)."""
    try:
        return memoryview(into).cast("B")
    except (TypeError, ValueError) as e:
        raise PayloadError(f"{what}: the buffer to read into is not one contiguous run of bytes ({e})") from e


def fetch_many(pool: PoolClient, refs: Sequence[Ref], intos: Sequence[Any], whats: Sequence[str],
               counts: dict[str, int] | None = None) -> list[tuple[memoryview, list[memoryview]]]:
    """`fetch` for several payloads in one pool request (one round trip per worker, not per payload; none
    for the blocks read in place). `counts`, if given: its `in_place` and `from_pool` grow by the blocks
    read each way."""
    bufs, views, keys, sizes, sums, labels, places = [], [], [], [], [], [], []
    for ref, into, what in zip(refs, intos, whats):
        buf = _bytes_of(bytearray(ref.total) if into is None else into, what)
        if buf.readonly or len(buf) < ref.total:
            raise PayloadError(f"{what}: buffer of {len(buf)} bytes (readonly={buf.readonly}) cannot take "
                               f"{ref.total} bytes", size=ref.total, limit=len(buf))
        bufs.append(buf[:ref.total])
        at = 0
        for size in ref.sizes:
            views.append(buf[at:at + size])
            at += size
        keys += ref.keys
        sizes += ref.sizes
        sums += ref.checksums
        labels += [what] * len(ref.keys)
        places += ref.places or [None] * len(ref.keys)
    here = read_placed(pool, places, views, sums)  # the same node's blocks, copied and verified
    rest = [i for i, ok in enumerate(here) if not ok]
    if counts is not None:
        counts["in_place"] += len(here) - len(rest)
        counts["from_pool"] += len(rest)
    if rest:
        _get_verified(pool, [keys[i] for i in rest], [sizes[i] for i in rest], [sums[i] for i in rest],
                      [views[i] for i in rest], [labels[i] for i in rest], [places[i] for i in rest])
    out, at = [], 0
    for buf, ref in zip(bufs, refs):
        out.append((buf, views[at:at + len(ref.keys)]))
        at += len(ref.keys)
    return out


def _get_verified(pool: PoolClient, keys: list[Key], sizes: list[int], sums: list[int], views: list[memoryview],
                  labels: list[str], places: list[Place | None]) -> None:
    """Get each block from the pool into its view (from the worker its place names first: `get_placed`;
    from its owners by placement where that worker held other bytes), checking its size and checksum.
    A block the pool does not hold is asked for again for up to COMMITTING_S: its producer's put may not be committed
    yet (a producer's puts do not wait for the worker: `kvpool.core.shm_stage`)."""
    got = _get(pool, keys, views, labels, places)
    missing = [i for i, n in enumerate(got) if n < 0]
    deadline, pause = time.monotonic() + COMMITTING_S, 0.001
    while missing and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
        for i, n in zip(missing, _get(pool, [keys[i] for i in missing], [views[i] for i in missing], labels,
                                      [places[i] for i in missing])):
            got[i] = n
        missing = [i for i in missing if got[i] < 0]
    good = [n == size and checksum(view) == want for n, size, want, view in zip(got, sizes, sums, views)]
    again = [i for i, ok in enumerate(good) if not ok and got[i] >= 0 and places[i] is not None]
    if again:  # the worker a place named held other bytes under the key: its owners by placement may not
        for i, n in zip(again, _get(pool, [keys[i] for i in again], [views[i] for i in again], labels,
                                    [None] * len(again))):
            got[i], good[i] = n, n == sizes[i] and checksum(views[i]) == sums[i]
    for key, size, n, what, ok in zip(keys, sizes, got, labels, good):
        if ok:
            continue
        if n < 0:
            raise PayloadError(f"{what}: block {key!r} ({size} bytes) is missing from the pool", key=key, size=size)
        if n != size:
            raise PayloadError(f"{what}: block {key!r} is {n} bytes; the message says {size}", key=key, size=n,
                               limit=size)
        raise CorruptPayload(f"{what}: block {key!r} fails its checksum", key=key, size=size)


def _get(pool: PoolClient, keys: list[Key], views: list[memoryview], labels: list[str],
         places: list[Place | None]) -> list[int]:
    try:
        return get_placed(pool, keys, views, places)
    except BufferSizeError as e:
        raise PayloadError(f"{labels[0]}: a block's size disagrees with its message: {e}", key=e.key, size=e.size,
                           limit=e.limit) from e


def overlapping(bufs: list[Any]) -> bool:
    """Whether any two of `bufs` (None: a fresh buffer, shared with none) share a byte. One that is not
    a contiguous buffer counts as sharing: read one at a time, `fetch_many` says what is wrong with it
    for its own layer."""
    spans: list[tuple[int, int]] = []
    for buf in bufs:
        if buf is None:
            continue
        try:
            view = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        except (TypeError, ValueError):
            return True
        if view.size:
            spans.append((view.ctypes.data, view.ctypes.data + view.size))
    spans.sort()
    return any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))


def by_bytes(refs: list[Ref], most: int) -> Iterator[list[Ref]]:
    """`refs` in runs of at most `most` bytes (a larger one alone), in order."""
    run: list[Ref] = []
    total = 0
    for ref in refs:
        if run and total + ref.total > most:
            yield run
            run, total = [], 0
        run.append(ref)
        total += ref.total
    if run:
        yield run
