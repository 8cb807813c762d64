"""The wire form of stream messages: a few NATS headers and, for payloads by reference, a small JSON body.

Kinds (header `Kvpool-Kind`): `inline` (the body is the payload), `ref` (the body names pool blocks:
keys, sizes in bytes, XXH3-64 checksums), `kv` (one layer of a prefill/decode handoff, by reference),
`kv-layers` (several consecutive layers of one request in one message: `Layers`) and `end` (a handoff
request is complete). Decoding ignores unknown JSON fields (forward compatible)
but checks every field it uses against `Limits` before anything is allocated: whatever arrives on a
stream's subjects may come from anyone who can publish there. Failures are `MalformedMessage`.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from kvpool.core import MAX_KEY_BYTES, Key, Place

from .errors import MalformedMessage

KIND = "Kvpool-Kind"
TYPE = "Kvpool-Type"
SIG = "Kvpool-Sig"
SENT = "Kvpool-Sent"
"""When a handoff message was published: ms since the epoch on its producer's clock (signed with the rest
of the `Kvpool-*` headers where a stream secret is set; without one, anyone may stamp any time). A receiver
drops a message older than the stream keeps messages, a replay (`handoff`); it never orders the chains of a
request id by it (clocks disagree, and producers of the version before carry none)."""
INLINE, REF, KV, KV_LAYERS, END = "inline", "ref", "kv", "kv-layers", "end"
KINDS = (INLINE, REF, KV, KV_LAYERS, END)
INVALID = "invalid"
"""The kind of a delivered message that could not be decoded (its `.error` says why)."""

_REQUEST = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEX32, _HEX64 = re.compile(r"^[0-9a-f]{32}$"), re.compile(r"^[0-9a-f]{64}$")
_U64 = 1 << 64
_MS_DIGITS = 16
"""Most digits a publish time in ms may have (today's have 13)."""
_NAME_MAX = 255
"""Longest worker id or arena name a place may carry."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a consumer accepts in one message, checked before it allocates or asks the pool anything.

    Sizes in bytes. `max_block` defaults to the pool's max block where the consumer has a pool."""

    max_block: int = 64 << 20
    max_keys: int = 65536
    """blocks one message may name (a worker takes at most 65536 keys per request)."""
    max_bytes: int = 1 << 30
    """total payload bytes one message may name."""
    max_layer: int = 65535
    """largest handoff layer number."""


def _fail(text: str, *, key: Key | None = None, size: int | None = None, limit: int | None = None) -> MalformedMessage:
    return MalformedMessage(text, key=key, size=size, limit=limit)


def _key_out(k: Key) -> Any:
    return k if isinstance(k, str) else {"hex": bytes(k).hex()}


def _key_in(k: Any) -> Key:
    """A key from the wire, checked as `kvpool.core.key_bytes` would check it (never raising anything
    but MalformedMessage: lone surrogates, bad hex, empty or long keys)."""
    if isinstance(k, dict) and isinstance(k.get("hex"), str) and len(k["hex"]) <= 2 * MAX_KEY_BYTES:
        try:
            raw = bytes.fromhex(k["hex"])
        except ValueError as e:
            raise _fail(f"key {k['hex'][:40]!r} is not hex: {e}") from None
        out: Key = raw
    elif isinstance(k, str) and len(k) <= MAX_KEY_BYTES:
        try:
            raw = k.encode()
        except UnicodeEncodeError as e:
            raise _fail(f"key {k[:40]!r} is not valid UTF-8 text: {e.reason}") from None
        out = k
    else:
        raise _fail(f"key {str(k)[:40]!r} is not text or {{'hex': ...}} of at most {MAX_KEY_BYTES} bytes",
                    limit=MAX_KEY_BYTES)
    if not 0 < len(raw) <= MAX_KEY_BYTES:
        raise _fail(f"key {raw[:16]!r} is {len(raw)} bytes; keys are 1 to {MAX_KEY_BYTES} bytes",
                    size=len(raw), limit=MAX_KEY_BYTES)
    return out


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    """`v` if it is an int (not a bool) in [lo, hi]."""
    if type(v) is not int:
        raise _fail(f"{what} {str(v)[:40]!r} is not an integer")
    if not lo <= v <= hi:
        raise _fail(f"{what} is {v}; it must be {lo} to {hi}", size=v, limit=hi)
    return v


def _request(v: Any) -> str:
    if not isinstance(v, str) or not _REQUEST.match(v):
        raise _fail(f"request id {str(v)[:80]!r} is not 1-64 letters, digits, '_' or '-'")
    return v


def _object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; deep nesting recurses
        raise _fail(f"malformed {what} body of {len(raw)} bytes: {type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(d, dict):
        raise _fail(f"{what} body of {len(raw)} bytes is a JSON {type(d).__name__}, not an object")
    return d


@dataclasses.dataclass(frozen=True)
class Seal:
    """Where a handoff message sits in its request's producer chain (see `handoff`): the chain's random
    `nonce`, the message's index `n` from 0, the secret `reveal`ed now (empty at n=0) and the hash
    `commit`ting to the next one (empty in an `end`). Hex strings."""

    nonce: str
    n: int
    reveal: str
    commit: str

    def out(self) -> dict[str, Any]:
        return {"nonce": self.nonce, "n": self.n, "reveal": self.reveal, "commit": self.commit}

    @classmethod
    def of(cls, d: Any) -> Seal:
        if not isinstance(d, dict):
            raise _fail("handoff message has no producer seal")
        nonce, reveal, commit = d.get("nonce"), d.get("reveal", ""), d.get("commit", "")
        if not isinstance(nonce, str) or not _HEX32.match(nonce):
            raise _fail(f"seal nonce {str(nonce)[:40]!r} is not 32 hex digits")
        for name, v in (("reveal", reveal), ("commit", commit)):
            if not isinstance(v, str) or (v and not _HEX64.match(v)):
                raise _fail(f"seal {name} {str(v)[:40]!r} is not empty or 64 hex digits")
        return cls(nonce, _int(d.get("n"), "seal index", 0, 1 << 31), reveal, commit)


@dataclasses.dataclass(frozen=True)
class Ref:
    """Pool blocks that together hold one payload (in order); sizes in bytes."""

    keys: list[Key]
    sizes: list[int]
    checksums: list[int]
    request: str = ""
    layer: int = -1
    seal: Seal | None = None
    places: list[Place | None] | None = None
    """where each block was committed in a same-node worker's arena (`kvpool.core.Place`; None: not
    through shared memory), so that a reader on that node copies it from there (`payload.fetch_many`).
    A hint: a reader trusts only its own mappings and the checksums, never the place."""

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def encode(self, seal: Seal | None = None) -> bytes:
        """The message's body; with `seal`, sealed by it in place of the reference's own (a producer's layer
        as it goes out)."""
        return json.dumps(self.body(seal), separators=(",", ":")).encode()

    def body(self, seal: Seal | None = None) -> dict[str, Any]:
        """The JSON object `encode` writes (a `Layers` message lists its layers' as they are)."""
        body: dict[str, Any] = {"keys": [_key_out(k) for k in self.keys], "sizes": self.sizes,
                                "checksums": self.checksums}
        if self.request:
            body.update(request=self.request, layer=self.layer)
        seal = seal or self.seal
        if seal is not None:
            body["seal"] = seal.out()
        if self.places is not None and any(p is not None for p in self.places):
            arenas: dict[tuple[str, str], int] = {}  # each (worker id, arena name) once: [index, offset, version]
            body["at"] = [None if p is None else [arenas.setdefault((p.worker, p.arena), len(arenas)), p.offset,
                                                  p.version] for p in self.places]
            body["arenas"] = [list(a) for a in arenas]
        return body

    @classmethod
    def decode(cls, raw: bytes, limits: Limits | None = None) -> Ref:
        """The reference in a `ref` or `kv` body, every field checked against `limits` (key count,
        block size, total bytes, layer) before the caller allocates anything for it."""
        return cls.of(_object(raw, "reference"), limits or Limits())

    @classmethod
    def of(cls, d: dict[str, Any], lim: Limits) -> Ref:
        """`decode` of a body already parsed (a JSON object)."""
        keys, sizes, sums = d.get("keys"), d.get("sizes"), d.get("checksums")
        if not (isinstance(keys, list) and isinstance(sizes, list) and isinstance(sums, list)):
            raise _fail("reference body lacks the lists keys, sizes and checksums")
        if not len(keys) == len(sizes) == len(sums):
            raise _fail(f"reference names {len(keys)} keys, {len(sizes)} sizes and {len(sums)} checksums; "
                        "they must match")
        if not 0 < len(keys) <= lim.max_keys:
            raise _fail(f"reference names {len(keys)} blocks; a message may name 1 to {lim.max_keys}",
                        size=len(keys), limit=lim.max_keys)
        sizes = [_int(s, "block size", 0, lim.max_block) for s in sizes]
        if sum(sizes) > lim.max_bytes:
            raise _fail(f"reference names {sum(sizes)} bytes; a message may name at most {lim.max_bytes}",
                        size=sum(sizes), limit=lim.max_bytes)
        out = [_key_in(k) for k in keys], sizes, [_int(c, "checksum", 0, _U64 - 1) for c in sums]
        places = _places(d["at"], d.get("arenas"), sizes) if "at" in d else None
        if "request" in d or "layer" in d or "seal" in d:
            return cls(*out, _request(d.get("request")), _int(d.get("layer"), "layer", 0, lim.max_layer),
                       Seal.of(d["seal"]) if "seal" in d else None, places)
        return cls(*out, places=places)


def _places(at: Any, arenas: Any, sizes: list[int]) -> list[Place | None]:
    """The blocks' places (`Ref.places`) from the wire: `arenas`, a list of [worker id, arena name], and
    `at`, one entry per block: null or [index in `arenas`, offset, version]."""
    if not isinstance(at, list) or len(at) != len(sizes):
        raise _fail(f"reference places are not a list of {len(sizes)} entries")
    if not (isinstance(arenas, list) and 0 < len(arenas) <= len(sizes)
            and all(isinstance(a, list) and len(a) == 2 and all(isinstance(n, str) and 0 < len(n) <= _NAME_MAX
                                                                for n in a) for a in arenas)):
        raise _fail(f"reference arenas {str(arenas)[:80]!r} are not a list of [worker id, arena name]")
    out: list[Place | None] = []
    for p, size in zip(at, sizes):
        if p is None:
            out.append(None)
            continue
        if not (isinstance(p, list) and len(p) == 3):
            raise _fail(f"block place {str(p)[:80]!r} is not [arena, offset, version]")
        worker, arena = arenas[_int(p[0], "block arena", 0, len(arenas) - 1)]
        out.append(Place(worker, arena, _int(p[1], "block offset", 0, _U64 - 1), size,
                         _int(p[2], "block version", 0, _U64 - 1)))
    return out


@dataclasses.dataclass(frozen=True)
class End:
    """A handoff request's end: how many layers its producer published, and its seal."""

    request: str
    layers: int | None
    seal: Seal | None = None

    def encode(self) -> bytes:
        body: dict[str, Any] = {"request": self.request, "layers": self.layers}
        if self.seal is not None:
            body["seal"] = self.seal.out()
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, limits: Limits | None = None) -> End:
        lim = limits or Limits()
        d = _object(raw, "end")
        layers = d.get("layers")
        return cls(_request(d.get("request")),
                   None if layers is None else _int(layers, "layer count", 0, lim.max_layer + 1),
                   Seal.of(d["seal"]) if "seal" in d else None)


MAX_LAYERS = 64
"""Most layers one `kv-layers` message may name (a producer sends at most `layer_hold.HOLD_LAYERS`)."""


@dataclasses.dataclass(frozen=True)
class Layers:
    """Layers of one handoff request in one message (`kv-layers`), with one seal for them all: a producer
    whose layers come faster than it is worth announcing each sends those that come together in one
    (`layer_hold`), so JetStream stores, and the decode side reads and checks, one message, not several.
    Each layer is a `Ref` of the request with no seal of its own, in the order published."""

    request: str
    refs: list[Ref]
    seal: Seal | None = None

    def encode(self) -> bytes:
        body: dict[str, Any] = {"request": self.request,
                                "layers": [{k: v for k, v in r.body().items() if k != "request"} for r in self.refs]}
        if self.seal is not None:
            body["seal"] = self.seal.out()
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, limits: Limits | None = None) -> Layers:
        """The layers in a `kv-layers` body, at most `MAX_LAYERS`, each checked as `Ref.decode` checks one
        (`limits` bound each layer, as they bound a `kv` message's one), before the caller allocates
        anything for them. A layer named twice is not refused here: the receiver fails the request for it
        (as for two messages)."""
        lim = limits or Limits()
        d = _object(raw, "layers")
        request, entries = _request(d.get("request")), d.get("layers")
        if not isinstance(entries, list) or not 0 < len(entries) <= MAX_LAYERS:
            raise _fail(f"layers body names {str(entries)[:40]!r}, not a list of 1 to {MAX_LAYERS} layers")
        refs = []
        for e in entries:
            if not isinstance(e, dict) or "request" in e or "seal" in e or "layer" not in e:
                raise _fail("a layer of a layers body is not an object with a layer and no request or seal "
                            "of its own")
            refs.append(Ref.of({**e, "request": request}, lim))
        return cls(request, refs, Seal.of(d["seal"]) if "seal" in d else None)

    def merged(self, limits: Limits | None = None) -> Ref:
        """All the layers' blocks as one reference (of the first layer's number), in order: what a plain
        `Consumer` reads of such a message, as one payload within `limits` (MalformedMessage past them)."""
        lim = limits or Limits()
        keys = [k for r in self.refs for k in r.keys]
        total = sum(r.total for r in self.refs)
        if len(keys) > lim.max_keys or total > lim.max_bytes:
            raise _fail(f"layers body names {len(keys)} blocks, {total} bytes; a message may name at most "
                        f"{lim.max_keys} blocks, {lim.max_bytes} bytes", size=total, limit=lim.max_bytes)
        return Ref(keys, [s for r in self.refs for s in r.sizes], [c for r in self.refs for c in r.checksums],
                   self.request, self.refs[0].layer, self.seal,
                   [p for r in self.refs for p in (r.places or [None] * len(r.keys))])


def sent_ms(headers: dict[str, str]) -> int | None:
    """The message's publish time (`SENT`), ms since the epoch; None where it carries none (a producer
    of an earlier version)."""
    value = headers.get(SENT)
    if value is None:
        return None
    value = value.strip()
    if not (value.isdigit() and value.isascii() and len(value) <= _MS_DIGITS):
        raise _fail(f"publish time {value[:40]!r} is not 1 to {_MS_DIGITS} decimal digits (ms since the epoch)")
    return int(value)


def kind_of(headers: dict[str, str] | None) -> str:
    """The message kind; messages from plain NATS publishers (no headers) count as inline bytes."""
    kind = (headers or {}).get(KIND, INLINE)
    if kind not in KINDS:
        raise _fail(f"unknown message kind {kind[:40]!r}; known: {', '.join(KINDS)}")
    return kind
