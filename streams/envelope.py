"""The wire form of stream messages: a few NATS headers and, for payloads by reference, a small JSON body.

Kinds (header `Kvpool-Kind`): `inline` (the body is the payload), `ref` (the body names pool blocks:
keys, sizes in bytes, XXH3-64 checksums), `kv` (one layer of a prefill/decode handoff, by reference)
and `end` (a handoff request is complete). Decoding ignores unknown JSON fields (forward compatible).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvpool.core import Key, ProtocolError

KIND = "Kvpool-Kind"
TYPE = "Kvpool-Type"
INLINE, REF, KV, END = "inline", "ref", "kv", "end"
KINDS = (INLINE, REF, KV, END)


def _key_out(k: Key) -> Any:
    return k if isinstance(k, str) else {"hex": bytes(k).hex()}


def _key_in(k: Any) -> Key:
    return bytes.fromhex(k["hex"]) if isinstance(k, dict) else str(k)


@dataclasses.dataclass(frozen=True)
class Ref:
    """Pool blocks that together hold one payload (in order); sizes in bytes."""

    keys: list[Key]
    sizes: list[int]
    checksums: list[int]
    request: str = ""
    layer: int = -1

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def encode(self) -> bytes:
        body: dict[str, Any] = {"keys": [_key_out(k) for k in self.keys], "sizes": self.sizes,
                                "checksums": self.checksums}
        if self.request:
            body.update(request=self.request, layer=self.layer)
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Ref:
        try:
            d = json.loads(raw)
            ref = cls([_key_in(k) for k in d["keys"]], [int(s) for s in d["sizes"]],
                      [int(c) for c in d["checksums"]], str(d.get("request", "")), int(d.get("layer", -1)))
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"malformed reference body of {len(raw)} bytes: {e}") from e
        if not len(ref.keys) == len(ref.sizes) == len(ref.checksums):
            raise ProtocolError(f"reference names {len(ref.keys)} keys, {len(ref.sizes)} sizes and "
                                f"{len(ref.checksums)} checksums; they must match")
        return ref


def kind_of(headers: dict[str, str] | None) -> str:
    """The message kind; messages from plain NATS publishers (no headers) count as inline bytes."""
    kind = (headers or {}).get(KIND, INLINE)
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}; known: {', '.join(KINDS)}")
    return kind
