"""Who sent a message: HMAC-SHA256 signatures under a shared stream secret, and the producer chain that
ties a handoff request's messages to the producer of its first one.

Signatures (`sign`/`verify`): with a secret configured (`secret=` or KVPOOL_STREAM_SECRET), a producer
signs every message over its subject, its `Kvpool-*` headers and its body; consumers and handoff
receivers with the secret drop messages that are unsigned or badly signed. Other headers are not signed.
A signature alone does not make a message fresh: a handoff message also carries its publish time
(`envelope.SENT`, a `Kvpool-*` header, so signed), by which a receiver drops a replay older than the
stream keeps messages (`handoff`); without a secret nothing authenticates that time.

The chain (`Sealer`/`ChainCheck`), always on: message n of a request reveals a random secret whose
SHA-256 the message before it committed to, so nobody who merely reads the stream can publish the next
message of a request before its producer does (the stream keeps publish order); message 0 carries the
request's random nonce. Without a stream secret, message 0 itself is not authenticated.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from .envelope import SIG, Seal
from .errors import HandoffError

ENV = "KVPOOL_STREAM_SECRET"
"""Environment variable holding the stream secret when none is passed."""
_DOMAIN = b"kvpool-stream-sig-v1\0"


def secret_from(secret: str | bytes | None) -> bytes | None:
    """The signing key: `secret`, else $KVPOOL_STREAM_SECRET; None (no signatures) when empty."""
    if secret is None:
        secret = os.environ.get(ENV, "")
    if isinstance(secret, str):
        secret = secret.encode("utf-8", "surrogateescape")
    return bytes(secret) or None


def _text(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


def sign(key: bytes, subject: str, headers: Mapping[str, str], body: bytes | memoryview) -> str:
    """The hex HMAC-SHA256 of a message: subject, `Kvpool-*` headers but the signature (sorted,
    values stripped as NATS delivers them), body."""
    mac = hmac.new(key, _DOMAIN + _text(subject) + b"\0", hashlib.sha256)
    for name in sorted(h for h in headers if h.startswith("Kvpool-") and h != SIG):
        mac.update(_text(name) + b"\0" + _text(headers[name].strip()) + b"\0")
    mac.update(b"\0")
    mac.update(body)
    return mac.hexdigest()


def verify(key: bytes, subject: str, headers: Mapping[str, str], body: bytes | memoryview) -> str | None:
    """None if the message carries a good signature under `key`; else why not."""
    got = headers.get(SIG)
    if not got:
        return "it is unsigned"
    if not hmac.compare_digest(_text(got), _text(sign(key, subject, headers, body))):
        return "its signature is wrong"
    return None


def _h(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()


class Sealer:
    """A producer's chain for one request: `next()` is the seal of its next message."""

    def __init__(self) -> None:
        drawn = secrets.token_bytes(64)  # (one draw: a request's first layer waits for this)
        self.nonce, self.n = drawn[:16].hex(), 0
        self.end_id = drawn[16:32].hex()
        """JetStream's duplicate id of the chain's end, in no message (a stranger who could read the nonce
        and claim an id made of it first would have the real end dropped as a duplicate)."""
        self._next = drawn[32:]
        self._revealed = b""
        self._before = (self._next, self._revealed, self.n)
        self.layers = 0

    def next(self, last: bool = False) -> Seal:
        self._before = (self._next, self._revealed, self.n)
        now, self._next = self._next, secrets.token_bytes(32)
        seal = Seal(self.nonce, self.n, self._revealed.hex(), "" if last else _h(now))
        self._revealed = now
        self.n += 1
        return seal

    def take_back(self) -> None:
        """Undo the last `next()`: its message was never sent, and the next one takes its place."""
        self._next, self._revealed, self.n = self._before


def two_chains(request: str, nonce: str, other: str) -> HandoffError:
    """The error of a request whose subject holds, or receives, messages of two producer chains."""
    return HandoffError(f"request {request!r}: messages of two producer chains ({nonce[:8]}… and {other[:8]}…): "
                        f"more than one request of id {request!r} is stored or published (ids must not be used "
                        "again within the stream's max_age), or a second producer or a forged message claims it")


class ChainCheck:
    """A receiver's view of one request's chain. `accept(seal)` is True for the request producer's next
    message, False for one to drop (forged or replayed: outside the chain), and raises HandoffError when
    a second chain's first message claims the request (two producers, or a forged first message; which
    is the real one cannot be told, so the request fails rather than mixing them)."""

    def __init__(self, request: str) -> None:
        self.request = request
        self.nonce: str | None = None
        self._commit, self.n = "", 0

    def accept(self, seal: Seal | None, last: bool = False) -> bool:
        """`last`: the message is the request's end (an end may be message 0: a request of no layers)."""
        if seal is None:
            return False
        if self.nonce is None:
            if seal.n != 0 or not (seal.commit or last):
                return False
            self.nonce, self._commit, self.n = seal.nonce, seal.commit, 1
            return True
        if seal.nonce != self.nonce and seal.n == 0 and (seal.commit or last):
            raise two_chains(self.request, self.nonce, seal.nonce)
        if seal.nonce != self.nonce or seal.n != self.n or not seal.reveal or \
                not hmac.compare_digest(_h(bytes.fromhex(seal.reveal)), self._commit):
            return False
        self._commit, self.n = seal.commit, self.n + 1
        return True
