"""Forged handoff messages (issue 11): a forged `end` once cut a live handoff to 2 of 4 layers, silently.
Now a handoff receiver takes a request's messages only from its producer's chain (and, with a stream
secret, only signed ones), checks their consistency, and fails with a typed error rather than ever
returning a short or mixed request. Real nats-server and `kvpool worker`; the forger publishes with nats-py."""
from __future__ import annotations

import dataclasses
import json
import secrets

import pytest
from streamhelp import forge

from kvpool.core import InvalidArgument, PoolClient
from kvpool.streams import (
    Consumer,
    HandoffError,
    HandoffReceiver,
    HandoffTimeout,
    Producer,
)
from kvpool.streams.envelope import End, Ref, Seal
from kvpool.streams.payload import put_blocks
from kvpool.streams.sealing import Sealer

LAYERS, BLOCK = 4, 64 << 10




def layer_bytes(request: str, layer: int) -> bytes:
    return bytes([layer + 1]) * BLOCK + request.encode()


def publish(p: Producer, request: str, layers: range) -> None:
    for layer in layers:
        p.publish_kv(request, layer, [f"{request}/L{layer}"], [layer_bytes(request, layer)])
    p.flush()


def read_all(nats_url: str, stream: str, pool: PoolClient, request: str, timeout: float = 5,
             **kw: object) -> tuple[list, HandoffReceiver]:
    rx = HandoffReceiver(stream, nats_url, pool, **kw)  # type: ignore[arg-type]
    try:
        return [(layer, bytes(bufs[0])) for layer, _, bufs in rx.iter_layers(request, timeout=timeout)], rx
    finally:
        rx.close()


def first_seal(nats_url: str, stream: str, pool: PoolClient) -> Seal:
    """What anyone who may read the stream learns: the seal of the request's first message."""
    with Consumer(stream, nats_url, pool=pool, fetch=False) as c:
        m = c.receive(2)
        assert m.kind == "kv"
        return m.ref.seal


def subj(stream: str, request: str) -> str:
    return f"kvpool.stream.{stream}.req.{request}"


def test_a_forged_end_mid_request_is_dropped_and_every_layer_arrives(nats, stream, pool):
    with Producer(stream, nats.url, pool=pool) as p:
        publish(p, "r1", range(2))
        seal = first_seal(nats.url, stream, pool)
        forge(nats.url, [
            (subj(stream, "r1"), json.dumps({"request": "r1", "layers": 2}).encode(), {"Kvpool-Kind": "end"}),
            (subj(stream, "r1"), End("r1", 2, Seal(seal.nonce, 2, secrets.token_hex(32), "")).encode(),
             {"Kvpool-Kind": "end"}),   # the real chain's nonce, read off the stream; the next secret guessed
            (subj(stream, "r1"), End("r1", 2, dataclasses.replace(seal, n=2)).encode(), {"Kvpool-Kind": "end"}),
        ])
        publish(p, "r1", range(2, LAYERS))
        p.end_request("r1")
    got, rx = read_all(nats.url, stream, pool, "r1")
    assert got == [(layer, layer_bytes("r1", layer)) for layer in range(LAYERS)]
    assert rx.counts["rejected"] == 3


def test_a_forged_layer_naming_the_forgers_own_blocks_is_dropped(nats, stream, pool):
    fake = put_blocks(pool, ["evil/L1"], [b"\x66" * BLOCK])   # right sizes and checksums: no authentication
    with Producer(stream, nats.url, pool=pool) as p:
        publish(p, "r2", range(1))
        seal = first_seal(nats.url, stream, pool)
        forged = dataclasses.replace(fake, request="r2", layer=1,
                                     seal=Seal(seal.nonce, 1, secrets.token_hex(32), secrets.token_hex(32)))
        forge(nats.url, [(subj(stream, "r2"), forged.encode(), {"Kvpool-Kind": "kv"}),
                         (subj(stream, "r2"), dataclasses.replace(forged, seal=None).encode(), {"Kvpool-Kind": "kv"})])
        publish(p, "r2", range(1, LAYERS))
        p.end_request("r2", LAYERS)
    got, rx = read_all(nats.url, stream, pool, "r2")
    assert got == [(layer, layer_bytes("r2", layer)) for layer in range(LAYERS)]
    assert rx.counts["rejected"] == 2


def test_oversized_or_malformed_layers_are_dropped_before_into_is_called(nats, stream, pool):
    asked: list[tuple[int, int]] = []
    forge(nats.url, [
        (subj(stream, "r3"), Ref(["k"], [64 << 30], [0], "r3", 0, Sealer().next()).encode(), {"Kvpool-Kind": "kv"}),
        (subj(stream, "r3"), b'{"keys": ["\\ud800"], "sizes": [1], "checksums": [0], "request": "r3", "layer": 0}',
         {"Kvpool-Kind": "kv"}),
        (subj(stream, "r3"), b"\xff", {"Kvpool-Kind": "end"}),
        (subj(stream, "r3"), b"hello", {}),
    ])
    with Producer(stream, nats.url, pool=pool) as p:
        publish(p, "r3", range(LAYERS))
        p.end_request("r3")
    with HandoffReceiver(stream, nats.url, pool) as rx:
        def into(layer: int, nbytes: int) -> bytearray:
            asked.append((layer, nbytes))
            return bytearray(nbytes)
        got = [layer for layer, _, _ in rx.iter_layers("r3", timeout=5, into=into)]
        assert rx.counts["rejected"] == 4
    assert got == list(range(LAYERS))
    assert asked == [(layer, len(layer_bytes("r3", layer))) for layer in range(LAYERS)]


def test_a_forged_first_message_fails_the_request_instead_of_mixing_it(nats, stream, pool):
    """Without a stream secret a request's first message is not authenticated: a forger who knows the
    request id before its producer starts can claim it. The producer's real messages then conflict with
    the forged chain: the receiver raises HandoffError instead of returning a mixed request."""
    fake = put_blocks(pool, ["evil/L0"], [b"\x66" * BLOCK], request="r4", layer=0)
    forge(nats.url, [(subj(stream, "r4"), dataclasses.replace(fake, seal=Sealer().next()).encode(),
                      {"Kvpool-Kind": "kv"})])
    with Producer(stream, nats.url, pool=pool) as p:
        publish(p, "r4", range(LAYERS))
        p.end_request("r4")
    with HandoffReceiver(stream, nats.url, pool) as rx, pytest.raises(HandoffError, match="two producer chains"):
        for _ in rx.iter_layers("r4", timeout=5):
            pass


def test_with_a_stream_secret_a_forged_first_message_is_dropped(nats, stream, pool, monkeypatch):
    monkeypatch.setenv("KVPOOL_STREAM_SECRET", "handoff-secret")
    fake = put_blocks(pool, ["evil/L0"], [b"\x66" * BLOCK], request="r5", layer=0)
    forge(nats.url, [(subj(stream, "r5"), dataclasses.replace(fake, seal=Sealer().next()).encode(),
                      {"Kvpool-Kind": "kv", "Kvpool-Sig": "0" * 64})])
    with Producer(stream, nats.url, pool=pool) as p:
        publish(p, "r5", range(LAYERS))
        p.end_request("r5")
    got, rx = read_all(nats.url, stream, pool, "r5")
    assert got == [(layer, layer_bytes("r5", layer)) for layer in range(LAYERS)]
    assert rx.counts["rejected"] == 1
    with Producer(stream, nats.url, pool=pool) as p:
        publish(p, "r6", range(1))
        p.end_request("r6")
    with pytest.raises(HandoffTimeout, match="after 0 layer"):   # a receiver with another secret takes nothing
        read_all(nats.url, stream, pool, "r6", timeout=1, secret="other")


def _own_chain(nats_url: str, stream: str, pool: PoolClient, request: str, layers: list[int], end: int) -> None:
    """Messages with a valid producer chain but inconsistent content (a buggy or compromised producer)."""
    chain, out = Sealer(), []
    for layer in layers:
        ref = put_blocks(pool, [f"{request}/{layer}"], [b"x" * 100], request=request, layer=layer)
        out.append((subj(stream, request), dataclasses.replace(ref, seal=chain.next()).encode(), {"Kvpool-Kind": "kv"}))
    out.append((subj(stream, request), End(request, end, chain.next(last=True)).encode(), {"Kvpool-Kind": "end"}))
    forge(nats_url, out)


def test_inconsistent_requests_are_typed_errors_never_short_reads(nats, stream, pool):
    _own_chain(nats.url, stream, pool, "dup", [0, 1, 1], 3)
    with HandoffReceiver(stream, nats.url, pool) as rx, pytest.raises(HandoffError, match="layer 1 twice"):
        list(rx.iter_layers("dup", timeout=5))
    _own_chain(nats.url, stream, pool, "short", [0, 1], 4)
    with HandoffReceiver(stream, nats.url, pool) as rx, pytest.raises(HandoffError, match="says 4 layer") as err:
        list(rx.iter_layers("short", timeout=5))
    assert (err.value.size, err.value.limit) == (2, 4)
    with Producer(stream, nats.url, pool=pool) as p:
        publish(p, "r7", range(2))
        with pytest.raises(InvalidArgument, match="published 2 layer"):
            p.end_request("r7", 4)
        with pytest.raises(InvalidArgument, match="layer"):
            p.publish_kv("r7", -1, ["k"], [b"x"])
