"""Pins with deadlines: blocks kept in DRAM (never evicted) until unpinned or until their pin expires.

A pin is on a key, not on a block: a key pinned before its block is committed (a put that carries a
pin) is committed pinned, and a block that replaces a pinned one is pinned too. Each pin has a holder
(a worker's client process, `Conn.holder`; 0 within a process's own cache): a key stays pinned while
any of its holders' pins runs, so two producers of the same block (a prefix that two prefill instances
share) do not end each other's pins, and one holder's short renewal does not cut another's long pin.
The deadline is what keeps a pin from outliving the client that made it: a client that dies without
unpinning (a stream producer, say) costs DRAM for at most that long.

What pins may cost a worker is bounded: a pin on a key that is not (yet) in DRAM waits at most
`PENDING_PIN_S` for its block and at most `MAX_PENDING_PINS` such pins exist at once (more are
refused and counted), so pins on keys that never arrive cannot grow the worker; renewing a pin does
not pile up deadlines; and every operation is linear in the keys it names.
"""
from __future__ import annotations

import heapq
import math
import numbers
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from .errors import InvalidArgument

if TYPE_CHECKING:
    pass

__all__ = ["pin_seconds", "process_holder", "MAX_PIN_S", "PENDING_PIN_S", "MAX_PENDING_PINS", "MAX_HOLDERS", "OVERFLOW",
           "Pins"]

MAX_PIN_S = 3600.0
"""The longest a pin lasts without being renewed, in seconds (longer requests are cut to it)."""
PENDING_PIN_S = 30.0
"""How long a pin on a key that is not in DRAM waits for its block (a put that carries a pin sends
the pin just before the block)."""
MAX_PENDING_PINS = 1 << 16
"""Pins waiting for their blocks, at most, per cache; further ones are refused (counted in `refused`)."""
MAX_HOLDERS = 8
"""Holders of one key's own pins, at most (a holder is a client process; HELLO names it), so that
clients that come and go cannot grow what one key's pins cost. The pins of further holders share the
key's overflow pin, which runs until the last deadline any of them asked for and which no unpin
shortens: past this many holders a pin may last longer than asked, never shorter."""
OVERFLOW = -1
"""The holder of a key's overflow pin (holder ids from clients are 0 or more)."""


_holder = 0


def _new_holder() -> None:
    global _holder
    _holder = secrets.randbits(63) | 1  # (0 is a process's own cache)


_new_holder()
os.register_at_fork(after_in_child=_new_holder)


def process_holder() -> int:
    """This process's holder id: what its connections tell a worker at HELLO, so that the worker keeps
    its pins apart from other processes'. Drawn at random at import, and again in a forked child."""
    return _holder


class Pinnable(Protocol):
    """A DRAM block as the pins see it: pinned blocks are never evicted."""

    pinned: bool


def pin_seconds(pin_s: object) -> float:
    """`pin_s` as a pin's length in seconds; InvalidArgument unless it is a finite real number (a NaN
    deadline would never pass, and would hold back the expiry of every pin behind it)."""
    if isinstance(pin_s, bool) or not isinstance(pin_s, numbers.Real) or not math.isfinite(pin_s):
        raise InvalidArgument(f"pin_s must be a finite number of seconds, not {pin_s!r}")
    return float(pin_s)


class Pins:
    """The pins of one DRAM tier, over its index `blocks` (key -> block). Not thread-safe: the cache
    calls it with its lock held. Expiry is lazy: `expire` (the cache calls it before it looks for
    room) and every `pin` apply the deadlines that have passed."""

    def __init__(self, blocks: Mapping[bytes, Pinnable]) -> None:
        self._blocks = blocks
        self._until: dict[bytes, float] = {}  # key -> monotonic deadline: the last of its holders'
        self._held: dict[bytes, dict[int, float]] = {}  # key -> each holder's deadline
        self._pending: dict[bytes, dict[int, float]] = {}  # key not in DRAM -> each holder's full length, for `claim`
        self._deadlines: list[tuple[float, bytes]] = []  # a heap; entries whose key was re-pinned are stale
        self.refused = 0
        """Pins refused because `MAX_PENDING_PINS` were already waiting for their blocks."""

    def pin(self, keys: Iterable[bytes], seconds: float, holder: int = 0) -> None:
        """Pin `keys` for `seconds` (at most MAX_PIN_S) from now on behalf of `holder`, renewing its
        earlier pin; `seconds` <= 0 ends its pin. A key stays pinned while any holder's pin runs, so one
        holder's unpin leaves another's in place (two producers of the same block). A key whose block is
        not in DRAM is pinned for at most PENDING_PIN_S (its block, committed meanwhile, gets each
        holder's whole pin through `claim`)."""
        now = time.monotonic()
        seconds = min(pin_seconds(seconds), MAX_PIN_S)
        self._expire(now)
        for key in keys:
            block = self._blocks.get(key)
            if seconds <= 0:
                self._unpin(key, holder, block, now)
                continue
            h = holder if self._room_for(key, holder, now) else OVERFLOW
            if block is not None:
                block.pinned = True
                self._pending.pop(key, None)
                self._hold(key, h, now + seconds)
            elif key in self._pending or len(self._pending) < MAX_PENDING_PINS:
                waiting = self._pending.setdefault(key, {})
                waiting[h] = max(seconds, waiting.get(h, 0.0)) if h == OVERFLOW else seconds
                self._hold(key, h, now + min(seconds, PENDING_PIN_S))
            else:
                self.refused += 1
        self._compact()

    def _room_for(self, key: bytes, holder: int, now: float) -> bool:
        """Whether `holder` gets a pin of its own on `key`: it holds one already, or fewer than
        `MAX_HOLDERS` do (holders whose pins ran out are let go first). If not, its pin goes to the
        key's overflow pin."""
        held = self._held.get(key)
        if held is None or holder in held or len(held) - (OVERFLOW in held) < MAX_HOLDERS:
            return True
        waiting = self._pending.get(key, {})
        for h in [h for h, until in held.items() if until <= now]:
            del held[h]
            waiting.pop(h, None)
        if not waiting:
            self._pending.pop(key, None)
        return len(held) - (OVERFLOW in held) < MAX_HOLDERS

    def _hold(self, key: bytes, holder: int, until: float) -> None:
        held = self._held.setdefault(key, {})
        held[holder] = max(until, held.get(OVERFLOW, 0.0)) if holder == OVERFLOW else until
        self._set(key, max(held.values()))

    def _unpin(self, key: bytes, holder: int, block: Pinnable | None, now: float) -> None:
        """End `holder`'s pin of `key`; the key stays pinned until the last of the other holders' pins."""
        held = self._held.get(key)
        if held is None:
            return
        held.pop(holder, None)
        waiting = self._pending.get(key)
        if waiting is not None:
            waiting.pop(holder, None)
            if not waiting:
                del self._pending[key]
        others = [until for until in held.values() if until > now]
        if others:
            self._set(key, max(others))
            return
        del self._held[key], self._until[key]
        self._pending.pop(key, None)
        if block is not None:
            block.pinned = False

    def _set(self, key: bytes, until: float) -> None:
        self._until[key] = until
        heapq.heappush(self._deadlines, (until, key))

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the live pins: renewals cost no memory."""
        if len(self._deadlines) > 2 * len(self._until) + 1024:
            self._deadlines = [(u, k) for k, u in self._until.items()]
            heapq.heapify(self._deadlines)

    def holds(self, key: bytes) -> bool:
        """Whether `key` has a live pin (a block committed under it now is committed pinned)."""
        return self._until.get(key, 0.0) > time.monotonic()

    def __bool__(self) -> bool:
        """Whether any pin is live or waiting (none: committing a block need not ask)."""
        return bool(self._until)

    def claim(self, key: bytes) -> bool:
        """`holds(key)`, for a block being committed under `key` (once per block put, so the common
        case of no pins at all costs one test): a pin that was waiting for this block now runs its
        whole length."""
        if not self._until:
            return False
        now = time.monotonic()
        if self._until.get(key, 0.0) <= now:
            return False
        waiting = self._pending.pop(key, None)
        if waiting is not None:
            held = self._held[key]
            held.update((h, now + seconds) for h, seconds in waiting.items() if held[h] > now)  # not those timed out
            self._set(key, max(held.values()))
        return True

    def left(self, key: bytes) -> None:
        """The pinned block of `key` left DRAM (removed, cleared, replaced): its pins wait for a block
        again, as a pin made before its block came does: for at most `PENDING_PIN_S`, then each runs
        what it had left once a block comes (a replacement, committed at once, keeps them whole). So
        pins on keys whose blocks are gone cost the worker no more than pins on keys never put do."""
        held = self._held.get(key)
        if held is None:
            return
        now = time.monotonic()
        if self._until[key] <= now or (key not in self._pending and len(self._pending) >= MAX_PENDING_PINS):
            self.refused += self._until[key] > now  # (a pin on an absent key would be refused so)
            del self._held[key], self._until[key]
            self._pending.pop(key, None)
            return
        waiting = self._pending.setdefault(key, {})
        for h, until in held.items():
            if until > now:
                waiting[h] = max(waiting.get(h, 0.0), until - now)
                held[h] = min(until, now + PENDING_PIN_S)
        self._set(key, max(held.values()))

    def counts(self) -> tuple[int, int, int]:
        """Live pins (those waiting for their blocks included), those waiting (a key some holder's pin
        still waits on), and pins refused so far."""
        now = time.monotonic()
        waiting = sum(1 for k, ws in self._pending.items() if any(self._held[k][h] > now for h in ws))
        return len(self._until), waiting, self.refused

    def expire(self) -> None:
        """Unpin the keys whose pins have expired."""
        if self._deadlines:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            until, key = heapq.heappop(self._deadlines)
            if self._until.get(key) == until:  # the last of its holders' deadlines
                del self._until[key], self._held[key]
                self._pending.pop(key, None)
                block = self._blocks.get(key)
                if block is not None:
                    block.pinned = False

    def check(self) -> list[str]:
        """What is wrong with the pins (empty when consistent): a pinned block has a pin, an unexpired
        pin on a key in DRAM pins its block, pending pins are pins and within their bound, every pin
        has its deadline in the heap."""
        now = time.monotonic()
        errors = []
        pinned = {k for k, b in self._blocks.items() if b.pinned}
        if pinned - self._until.keys():
            errors.append(f"{len(pinned - self._until.keys())} pinned DRAM blocks have no pin, e.g. "
                          f"{min(pinned - self._until.keys())[:24]!r}")
        unpinned = {k for k, u in self._until.items()
                    if u > now and k in self._blocks and k not in self._pending and k not in pinned}
        if unpinned:
            errors.append(f"{len(unpinned)} pinned keys have an unpinned DRAM block, e.g. {min(unpinned)[:24]!r}")
        if self._pending.keys() - self._until.keys():
            errors.append(f"{len(self._pending.keys() - self._until.keys())} pending pins are not pins")
        if any(len(held) - (OVERFLOW in held) > MAX_HOLDERS for held in self._held.values()):
            errors.append(f"a key has more than {MAX_HOLDERS} pin holders")
        if len(self._pending) > MAX_PENDING_PINS or self.refused < 0:
            errors.append(f"{len(self._pending)} pending pins (at most {MAX_PENDING_PINS}), {self.refused} refused")
        if set(self._until.items()) - {(k, u) for u, k in self._deadlines}:
            errors.append("a pin's deadline is missing from the deadline heap")
        if self._held.keys() != self._until.keys() or any(
                not held or max(held.values()) > self._until[k] for k, held in self._held.items()):
            errors.append("a pin's deadline is not the last of its holders'")
        if any(not self._held.get(k, {}).keys() >= waiting.keys() for k, waiting in self._pending.items()):
            errors.append("a pending pin's holder holds no pin")
        return errors

