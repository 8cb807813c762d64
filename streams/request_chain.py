"""One handoff request's messages put back in their producer chain's order (`RequestChain`), whichever way
each came (live or read back from the stream): what the decode side's `HandoffReceiver` yields from."""
from __future__ import annotations

from collections.abc import Callable

from . import envelope as env
from .errors import ForgedMessage, StreamError
from .live import Raw
from .sealing import ChainCheck, two_chains

__all__ = ["Item", "RequestChain"]

_AHEAD = 1024
"""Messages ahead of their place in the chain a receiver holds while it waits for the ones before."""

Item = env.Ref | env.Layers | env.End


class RequestChain:
    """One request's messages put back in their producer chain's order, whichever way each came."""

    def __init__(self, request: str, reject: Callable[[Raw, StreamError], None]) -> None:
        self.chain = ChainCheck(request)
        self._reject = reject
        self._ahead: dict[int, list[tuple[Item, Raw]]] = {}
        self._bodies: dict[int, bytes] = {}  # body of each accepted message, by its index in the chain
        self.gap = False

    def take(self, item: Item, raw: Raw) -> list[tuple[Item, Raw]]:
        """The messages now in order (accepted by the chain): `item` and any that waited for it."""
        seal, chain = item.seal, self.chain
        if seal is not None and chain.nonce is not None and seal.nonce == chain.nonce and seal.n < chain.n:
            if self._bodies.get(seal.n) != raw.data:  # the same message read twice counts once
                self._reject(raw, ForgedMessage("it repeats a place in the request's chain (forged or replayed)"))
            return []
        if seal is not None and seal.n > chain.n and (chain.nonce is None or seal.nonce == chain.nonce):
            if sum(map(len, self._ahead.values())) >= _AHEAD:
                self._reject(raw, ForgedMessage(f"more than {_AHEAD} messages wait ahead of their place"))
            else:
                self._ahead.setdefault(seal.n, []).append((item, raw))
                self.gap = True
            return []
        out = self._judge([(item, raw)])
        while out and not isinstance(out[-1][0], env.End) and chain.n in self._ahead:
            out += self._judge(self._ahead.pop(chain.n))
        self.gap = bool(self._ahead)
        return out

    def _judge(self, candidates: list[tuple[Item, Raw]]) -> list[tuple[Item, Raw]]:
        """The one of `candidates` (messages claiming the chain's next place) that the chain accepts;
        HandoffError for a message of another chain than the accepted one."""
        out: list[tuple[Item, Raw]] = []
        n = self.chain.n
        for item, raw in candidates:
            self._one_chain(item)
            if not out and self.chain.accept(item.seal, last=isinstance(item, env.End)):
                self._bodies[n] = raw.data
                out.append((item, raw))
            elif not out or self._bodies.get(n) != raw.data:
                self._reject(raw, ForgedMessage("it is outside the request's producer chain (forged or replayed)"))
        return out

    def drop_waiting(self) -> None:
        """The request ended: what still waits ahead of its place never had one (HandoffError where one is
        of another chain)."""
        for waiting in self._ahead.values():
            for item, raw in waiting:
                self._one_chain(item)
                self._reject(raw, ForgedMessage("it is outside the request's producer chain (after its end)"))
        self._ahead.clear()

    def _one_chain(self, item: Item) -> None:
        nonce = self.chain.nonce
        if item.seal is not None and nonce is not None and item.seal.nonce != nonce:
            raise two_chains(self.chain.request, nonce, item.seal.nonce)
