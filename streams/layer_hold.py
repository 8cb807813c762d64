"""The layers a producer published and has not announced yet: while a request's layers come faster than
`HOLD_S` apart, those after its first wait to go together, `HOLD_LAYERS` at most, in one `kv-layers`
message (`envelope.Layers`). What a layer's announcement costs besides its bytes (JetStream storing the
message and acknowledging it, the producer sealing, sending and reading that acknowledgement, the decode
side reading and checking it) then falls on several layers: a same-node handoff of 32 x 1 MiB layers on
2 CPUs went 2.23-2.29 -> 2.79-2.99 GB/s (medians of 50 requests; docs/BENCHMARKS.md, run AY).

A request's first layer, and any after a pause of `HOLD_S`, goes at once (the decode side waiting for
layer 0 waits no longer); none waits more than `HOLD_S` after the producer's last layer (its `Alarm`
sends it then, and again while that fails, as does the producer's next call), nor past the request's
end, which sends what is held first. Only one request's layers wait at a time: a layer of another request
sends them first. Layers whose one message would pass the server's max_payload go one to a message."""
from __future__ import annotations

from .envelope import Ref
from .sealing import Sealer

__all__ = ["HOLD_BYTES", "HOLD_KEYS", "HOLD_LAYERS", "HOLD_S", "LayerHold"]

HOLD_S = 0.002
"""Layers that come within this many seconds of each other wait to go together (the pool's stager holds
the same layers' commits as long: `kvpool.core.shm_stage.HOLD_S`)."""
HOLD_LAYERS = 8
"""Most layers one message names."""
HOLD_KEYS = 1024
"""Most blocks the layers waiting together may name (a message stays far below NATS's max payload)."""
HOLD_BYTES = 16 << 20
"""Most bytes the layers waiting together may name: layers this large gain nothing from going together
(one larger goes alone, as it did), and a plain `Consumer` of the stream, which reads such a message as
one payload within its `Limits`, need not allow more than this for one."""


class LayerHold:
    """One request's layers waiting to be announced together, and when each request's last layer came."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s  # (0: every layer goes at once)
        self.request: str | None = None
        self.subject = ""
        self.chain: Sealer | None = None  # the request's (its message is sealed as the chain's next)
        self.refs: list[Ref] = []
        self.since = 0.0  # when the first of `refs` was published (time.monotonic)
        self._keys = self._bytes = 0
        self._last: tuple[str, float] | None = None  # (request, time.monotonic) of the last layer published
        self._last_before: tuple[str, float] | None = None  # (what `drop_last` puts back)

    def fits(self, request: str, ref: Ref) -> bool:
        """Whether `ref`, a layer of `request`, may join the layers waiting (else they go first): none
        wait, or they are of `request` and with it stay within `HOLD_KEYS` blocks and `HOLD_BYTES`."""
        return not self.refs or (self.request == request and self._keys + len(ref.keys) <= HOLD_KEYS
                                 and self._bytes + ref.total <= HOLD_BYTES)

    def add(self, request: str, subject: str, chain: Sealer, ref: Ref, now: float) -> bool:
        """Take `ref`, a layer of `request` (of chain `chain`) published `now` that `fits`; whether it may
        wait (else everything waiting, it included, goes now)."""
        gap = now - self._last[1] if self._last is not None and self._last[0] == request else float("inf")
        self._last_before, self._last = self._last, (request, now)
        if not self.refs:
            self.request, self.subject, self.chain, self.since = request, subject, chain, now
        self.refs.append(ref)
        self._keys += len(ref.keys)
        self._bytes += ref.total
        # wait unless the layers come slower than HOLD_S, the message is full, or the next layer, as far
        # behind as this one, would find the first one waiting for HOLD_S
        return not (gap >= self.hold_s or len(self.refs) >= HOLD_LAYERS or self._keys >= HOLD_KEYS
                    or self._bytes >= HOLD_BYTES or now + gap > self.since + self.hold_s)

    def drop_last(self) -> None:
        """Give back the last layer taken: its call raised, and it may be published again."""
        ref = self.refs.pop()
        self._keys -= len(ref.keys)
        self._bytes -= ref.total
        self._last = self._last_before  # (a first layer tried again still goes at once)

    def take_first(self) -> None:
        """The first layer waiting went out on its own (the others wait on)."""
        ref = self.refs.pop(0)
        self._keys -= len(ref.keys)
        self._bytes -= ref.total

    def clear(self) -> None:
        """The layers held went out."""
        self.refs = []
        self._keys = self._bytes = 0
