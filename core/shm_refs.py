"""Where committed same-node blocks lie, and reading them there: the records a put can hand to a reader.

A same-node put (`ShmTransport`) learns at commit where each block lies in its worker's arena; it reports
that to `committed`, which keeps it only for the keys a caller asked about (`recording`): a `Place`
(worker id, arena name, offset, size, version). A reader on the same node that maps the same arena
read-only copies the block straight from its mapping (`copy_placed`), with no round trip to the worker,
and checks the checksum over the copied bytes. Nothing here trusts a place: an arena the reader does not
map already, an offset outside its mapping, or a slot the worker has since freed and reused (evicted,
removed, overwritten) is a failure to read in place, never wrong bytes, and the caller falls back to the
pool's own get. `kvpool.core.shm_read` finds a client's mappings.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from .fastcopy import copy_hash
from .records import WorkerInfo

__all__ = ["Place", "Recorder", "ArenaLookup", "recording", "committed", "copy_placed"]


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a committed block lay in a worker's shared-memory arena when its writer committed it."""

    worker: str
    """the worker's id"""
    arena: str
    """its arena's name (a restarted worker has another: its places are then never read)"""
    offset: int
    size: int
    version: int
    """the block's version (`kvpool.core.versions`)"""


class Recorder:
    """The places of the keys one caller put (see `recording`)."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self._want = frozenset(keys)
        self._places: dict[bytes, Place] = {}

    def note(self, info: WorkerInfo, keys: Sequence[bytes], offsets: list[int], sizes: list[int],
             versions: list[int]) -> None:
        for key, off, size, version in zip(keys, offsets, sizes, versions):
            if key in self._want:
                self._places.setdefault(key, Place(info.worker_id, info.arena, off, size, version))

    def places(self, keys: Sequence[bytes]) -> list[Place | None]:
        """The place of each key (None: not put through shared memory while recording)."""
        return [self._places.get(k) for k in keys]


_active: list[Recorder] = []
_lock = threading.Lock()


@contextmanager
def recording(keys: Sequence[bytes]) -> Iterator[Recorder]:
    """Record where the same-node puts made inside the `with` (any thread) commit `keys`."""
    rec = Recorder(keys)
    with _lock:
        _active.append(rec)
    try:
        yield rec
    finally:
        with _lock:
            _active.remove(rec)


def recording_now() -> bool:
    """Whether anyone records where same-node puts commit their keys (`recording`)."""
    return bool(_active)


def committed(info: WorkerInfo, keys: Sequence[bytes], offsets: np.ndarray, sizes: np.ndarray,
              versions: np.ndarray) -> None:
    """A same-node writer committed `keys` at `offsets` of worker `info`'s arena (all of them stored).
    Nothing to do unless someone is recording."""
    if not _active:
        return
    offs, lens, vers = offsets.tolist(), sizes.tolist(), versions.tolist()
    with _lock:
        for rec in _active:
            rec.note(info, keys, offs, lens, vers)


ArenaLookup = Callable[[str, str], "memoryview | None"]
"""lookup(worker id, arena name) -> that arena as this process maps it read-only, or None."""


def copy_placed(lookup: ArenaLookup, places: Sequence[Place | None], views: Sequence[memoryview],
                checksums: Sequence[int]) -> tuple[list[bool], int]:
    """Copy each placed block from its arena into its view (of the block's size) and check `checksums`
    over the copied bytes: True where the view now holds the block, False where it must be read another
    way (no place, an arena not mapped, a place outside the mapping or of another size, a checksum that
    disagrees: a view left False may hold anything). Also the highest version read (0: none)."""
    out: list[bool] = []
    newest = 0
    arenas: dict[tuple[str, str], memoryview | None] = {}
    for place, view, want in zip(places, views, checksums):
        ok = False
        if place is not None and place.size == view.nbytes:
            where = (place.worker, place.arena)
            arena = arenas[where] if where in arenas else arenas.setdefault(where, lookup(*where))
            end = place.offset + place.size
            if arena is not None and place.offset >= 0 and end <= arena.nbytes:
                try:
                    ok = copy_hash(view, arena[place.offset:end]) == want  # of the bytes the view got
                except ValueError:  # the mapping was released under us (its transport closed): not read
                    arenas[where] = None
                newest = max(newest, place.version) if ok else newest
        out.append(ok)
    return out, newest
