"""Adversarial checks of held handoff announcements (`layer_hold`, `kv-layers` messages): what the producer
does at the edges (NATS's max_payload, its bound on open requests, hold_s 0, the alarm's failures, a producer
dropped unclosed) and what receivers and plain consumers make of forged or malformed `kv-layers` messages.
Real nats-server and `kvpool worker`; the forger publishes with nats-py."""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import threading
import time
from typing import Any

import numpy as np
import pytest
from handoffhelp import forge, layer_block, receive_layers

from kvpool.core import PoolClient
from kvpool.streams import (
    AsyncConsumer,
    Consumer,
    HandoffError,
    HandoffReceiver,
    Producer,
    StreamUnavailable,
    stream_info,
)
from kvpool.streams import producer as producer_mod
from kvpool.streams.envelope import MAX_LAYERS, Layers, Limits, Ref
from kvpool.streams.errors import MalformedMessage
from kvpool.streams.layer_hold import HOLD_KEYS, LayerHold
from kvpool.streams.payload import put_blocks
from kvpool.streams.sealing import Sealer, sign
from kvpool.streams.wire import Wire

BLOCK = 64 << 10
LONG_S = 0.5
"""A hold far longer than a test's layers take to come: which layers go together does not depend on the
machine's speed."""


def _block(request: str, layer: int) -> np.ndarray:
    return layer_block(request, layer, BLOCK)


def _publish(p: Producer, request: str, layers: range) -> None:
    for layer in layers:
        p.publish_kv(request, layer, [f"{request}/L{layer}"], [_block(request, layer)])


def _receive(rx: HandoffReceiver, request: str, timeout: float = 10) -> list[int]:
    return receive_layers(rx, request, BLOCK, timeout)


def _kinds(url: str, stream: str, pool: PoolClient) -> list[str]:
    got: list[str] = []
    with Consumer(stream, url, pool=pool, fetch=False) as c:
        while (msg := c.receive(1.0)) is not None:
            got.append(msg.kind)
            msg.ack()
    return got


def _subj(stream: str, request: str) -> str:
    return f"kvpool.stream.{stream}.req.{request}"


def _long_keys(request: str, layer: int, n: int) -> list[bytes]:
    """`n` binary keys of 511 bytes (the longest a key may be): ~1 KiB each in an announcement (hex)."""
    tag = f"{request}/{layer}/".encode()
    return [(tag + i.to_bytes(4, "big")).ljust(511, b"k") for i in range(n)]


def _wait_messages(url: str, stream: str, n: int, within: float = 5) -> int:
    deadline = time.monotonic() + within
    while (got := stream_info(url, stream)["messages"]) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


# -- defects -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("limits", [Limits(max_bytes=BLOCK), Limits(max_keys=1)], ids=["bytes", "keys"])
def test_adv_hold_a_receiver_bounding_one_layer_still_takes_held_layers(nats, make_stream, pool,
                                                                        limits: Limits) -> None:
    """A HandoffReceiver's `limits` bound "what one layer may name" (its docstring); a receiver set to a
    layer's size took every layer before the change. Held layers go as one message naming several layers'
    blocks, and the receiver checks that message's sum against the one-layer bound: it drops it as
    malformed, and the request, every layer of which fits the bound, ends in HandoffTimeout."""
    s = make_stream()
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        _publish(p, "lim", range(4))
        p.end_request("lim", 4)
    assert "kv-layers" in _kinds(nats.url, s, pool)
    with HandoffReceiver(s, nats.url, pool, limits=limits) as rx:
        assert _receive(rx, "lim", timeout=3) == [0, 1, 2, 3]
    assert rx.counts["rejected"] == 0


def test_adv_hold_layers_held_past_max_payload_do_not_wedge_the_producer(nats, make_stream, pool) -> None:
    """Seven layers of 146 keys each, each layer's announcement ~160 KB (far below NATS's 1 MiB max_payload):
    they wait together (1022 blocks, within HOLD_KEYS), and their one message is ~1.1 MB, over max_payload.
    The send is refused (StreamRefused) and the layers stay waiting, so every later send tries the same
    message again: the end of the request is refused for ever, and so is any other request's next layer."""
    s = make_stream()
    n = 146
    assert 7 * n <= HOLD_KEYS
    small = bytes(64)
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        for layer in range(8):  # layer 0 alone; 1 to 7 wait together
            p.publish_kv("big", layer, _long_keys("big", layer, n), [small] * n)
        p.end_request("big", 8)  # refused: the held message is over max_payload
        _publish(p, "next", range(2))  # and so is every call after it
        p.end_request("next", 2)
    with HandoffReceiver(s, nats.url, pool) as rx:
        got = [layer for layer, keys, _ in rx.iter_layers("big", timeout=5)]
        assert got == list(range(8))
        assert _receive(rx, "next") == [0, 1]


def test_adv_hold_a_layer_is_not_refused_for_the_size_of_layers_held_before_it(nats, make_stream, pool) -> None:
    """The call whose layer fills the held message (8 layers x 128 keys of ~1 KiB each: ~1.1 MB) raises
    StreamRefused (max_payload), though its own layer's announcement is ~140 KB: a refusal raised for the
    wrong layer, after the blocks of the seven layers before it, whose calls returned, were unpinned
    (Announcer's refused callback) while they still wait to be announced."""
    s = make_stream()
    n = HOLD_KEYS // 8
    small = bytes(64)
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        for layer in range(9):  # layer 0 alone; 1 to 8 together
            p.publish_kv("fill", layer, _long_keys("fill", layer, n), [small] * n)
        p.end_request("fill", 9)
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert [layer for layer, _, _ in rx.iter_layers("fill", timeout=5)] == list(range(9))


def test_adv_hold_a_held_layer_of_the_oldest_request_does_not_break_the_newest(nats, make_stream, pool,
                                                                              monkeypatch) -> None:
    """At the producer's bound on open requests (`_OPEN_REQUESTS`, 4096; 1 here) a new request's layer
    makes its chain (evicting the oldest, whose layer waits) before it sends the waiting layer; that send
    makes the evicted request a new chain, which evicts the new request's chain in turn. The new request's
    layer then goes on a third chain and is counted on the evicted one: its end says 0 layers (or
    end_request(.., 1) raises InvalidArgument). Before the change the new request was whole."""
    monkeypatch.setattr(producer_mod, "_OPEN_REQUESTS", 1)
    s = make_stream()
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        _publish(p, "old", range(2))  # layer 0 goes, layer 1 waits
        _publish(p, "new", range(1))
        p.end_request("new", 1)
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "new", timeout=5) == [0]


def test_adv_hold_hold_s_0_never_holds_a_layer() -> None:
    """hold_s=0 is documented as "each at once"; two layers stamped the same monotonic time (a coarse clock:
    Windows' is ~15 ms) make the second wait for the alarm instead."""
    hold = LayerHold(hold_s=0)
    ref = Ref(["k"], [1], [0], "r", 0)
    assert not hold.add("r", "s", Sealer(), ref, 5.0)
    hold.clear()
    assert not hold.add("r", "s", Sealer(), dataclasses.replace(ref, layer=1), 5.0)


# -- properties worth keeping -------------------------------------------------------------------------

def test_adv_hold_hold_s_0_sends_each_layer_as_its_own_kv_message(nats, make_stream, pool) -> None:
    s = make_stream()
    with Producer(s, nats.url, pool=pool, hold_s=0) as p:
        _publish(p, "each", range(5))
        p.end_request("each", 5)
    assert _kinds(nats.url, s, pool) == ["kv"] * 5 + ["end"]


def test_adv_hold_a_failed_alarm_send_goes_with_the_end_once(nats, make_stream, pool, monkeypatch) -> None:
    """The alarm's send fails (NATS blip): the layers wait on, and end_request sends them first, each once."""
    s, failed = make_stream(), []
    real = Wire.publish

    def flaky(self: Wire, subj: str, body: bytes, headers: dict[str, str] | None = None, reply: str = "") -> None:
        if threading.current_thread().name == "kvpool-announce" and not failed:
            failed.append((headers or {}).get("Kvpool-Kind"))
            raise StreamUnavailable("NATS at nats://test: sending failed (injected)")
        real(self, subj, body, headers, reply)
    monkeypatch.setattr(Wire, "publish", flaky)
    with Producer(s, nats.url, pool=pool, hold_s=0.05) as p:
        _publish(p, "blip", range(3))
        deadline = time.monotonic() + 5
        while not failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failed == ["kv-layers"]
        p.end_request("blip", 3)
    assert _kinds(nats.url, s, pool) == ["kv", "kv-layers", "end"]
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "blip") == [0, 1, 2]
    assert rx.counts["rejected"] == 0


def test_adv_hold_close_sends_what_waits(nats, make_stream, pool) -> None:
    s = make_stream()
    p = Producer(s, nats.url, pool=pool, hold_s=LONG_S)
    _publish(p, "c", range(3))
    p.close()
    assert _kinds(nats.url, s, pool) == ["kv", "kv-layers"]


def test_adv_hold_a_dropped_producer_lets_its_alarm_thread_end(nats, make_stream, pool) -> None:
    """A producer dropped unclosed while layers wait: it is collected (the alarm holds it weakly), its alarm
    thread ends and nothing hangs (the waiting layers go with it, as README's crash table says)."""
    s = make_stream()
    p = Producer(s, nats.url, pool=pool, hold_s=LONG_S)
    _publish(p, "gone", range(3))
    alarms = [t for t in threading.enumerate() if t.name == "kvpool-announce"]
    assert alarms
    del p
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in alarms) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.is_alive() for t in alarms)


def test_adv_hold_caller_and_alarm_interleave_without_loss(nats, make_stream, pool) -> None:
    """Layers coming about as far apart as the hold, so that the alarm and the caller race for the same
    waiting layers, for requests in turns: every request arrives whole, nothing is rejected."""
    s, hold_s = make_stream(), 0.002
    rng = np.random.default_rng(3)
    requests = [f"race{i}" for i in range(4)]
    layers = 12
    with Producer(s, nats.url, pool=pool, hold_s=hold_s) as p:
        for layer in range(layers):
            for request in requests:
                _publish(p, request, range(layer, layer + 1))
                time.sleep(float(rng.uniform(0, 2 * hold_s)))
        for request in requests:
            p.end_request(request, layers)
    with HandoffReceiver(s, nats.url, pool) as rx:
        for request in requests:
            assert _receive(rx, request) == list(range(layers))
    assert rx.counts["rejected"] == 0


def test_adv_hold_same_request_alarm_race(nats, make_stream, pool) -> None:
    """One request's layers about one hold apart: the alarm often takes the waiting ones as the caller adds
    the next; the chain stays in order and the end's count agrees."""
    s, hold_s = make_stream(), 0.002
    rng = np.random.default_rng(5)
    layers = 40
    with Producer(s, nats.url, pool=pool, hold_s=hold_s) as p:
        for layer in range(layers):
            _publish(p, "one", range(layer, layer + 1))
            time.sleep(float(rng.uniform(0, 2 * hold_s)))
        p.end_request("one", layers)
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "one") == list(range(layers))
    assert rx.counts["rejected"] == 0


def _refs(pool: PoolClient, request: str, layers: range) -> list[Ref]:
    return [put_blocks(pool, [f"{request}/L{layer}"], [_block(request, layer)], request=request, layer=layer)
            for layer in layers]


def test_adv_hold_a_layer_in_a_layers_message_and_again_in_a_kv_message_fails_the_request(
        nats, make_stream, pool) -> None:
    s, chain = make_stream(), Sealer()
    refs = _refs(pool, "twice", range(3))
    subj = _subj(s, "twice")
    forge(nats.url, [
        (subj, Layers("twice", refs[:2], chain.next()).encode(), {"Kvpool-Kind": "kv-layers"}),
        (subj, dataclasses.replace(refs[1], seal=chain.next()).encode(), {"Kvpool-Kind": "kv"}),
    ])
    with HandoffReceiver(s, nats.url, pool) as rx, pytest.raises(HandoffError, match="layer 1 twice"):
        list(rx.iter_layers("twice", timeout=5))


def test_adv_hold_a_layers_message_of_another_request_is_dropped(nats, make_stream, pool) -> None:
    """A kv-layers message on request a's subject that names request b (a stranger's first message) is
    dropped; a's own layers all arrive."""
    s = make_stream()
    forged = _refs(pool, "bb", range(1, 3))
    forge(nats.url, [(_subj(s, "aa"), Layers("bb", forged, Sealer().next()).encode(), {"Kvpool-Kind": "kv-layers"})])
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        _publish(p, "aa", range(3))
        p.end_request("aa", 3)
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "aa") == [0, 1, 2]
    assert rx.counts["rejected"] == 1


def test_adv_hold_with_a_secret_unsigned_or_missigned_layers_messages_are_dropped(nats, make_stream, pool) -> None:
    s, secret = make_stream(), "hold-secret"
    refs = _refs(pool, "sig", range(3))
    subj = _subj(s, "sig")
    chain = Sealer()
    body = Layers("sig", refs[1:], chain.next()).encode()
    headers = {"Kvpool-Kind": "kv-layers"}
    bad = {**headers, "Kvpool-Sig": sign(b"another secret", subj, headers, body)}
    forge(nats.url, [(subj, body, headers), (subj, body, bad)])
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S, secret=secret) as p:
        _publish(p, "sig", range(3))
        p.end_request("sig", 3)
    assert _kinds(nats.url, s, pool).count("kv-layers") == 3
    with HandoffReceiver(s, nats.url, pool, secret=secret) as rx:
        assert _receive(rx, "sig") == [0, 1, 2]
    assert rx.counts["rejected"] == 2


@pytest.mark.parametrize("layers", [
    [{"keys": ["k"], "sizes": [1], "checksums": [0], "layer": "1"}],
    [{"keys": "k", "sizes": [1], "checksums": [0], "layer": 1}],
    [{"keys": ["k"], "sizes": [-1], "checksums": [0], "layer": 1}],
    [{"keys": ["k"], "sizes": [1], "checksums": [0], "layer": True}],
    ["not an entry"],
    [None],
    [[1, 2, 3]],
    [{"keys": [], "sizes": [], "checksums": [], "layer": 1}],
    [{"keys": ["k"], "sizes": [1], "checksums": [0], "layer": 1, "at": [[5, 0, 0]], "arenas": [["w", "a"]]}],
], ids=["layer-str", "keys-str", "negative-size", "layer-bool", "str-entry", "null-entry", "list-entry",
        "no-keys", "bad-place"])
def test_adv_hold_malformed_layer_entries_are_malformed(layers: list[Any]) -> None:
    body = json.dumps({"request": "r", "layers": layers, "seal": Sealer().next().out()}).encode()
    with pytest.raises(MalformedMessage):
        Layers.decode(body)


def test_adv_hold_a_layers_list_longer_than_the_bound_is_refused_before_its_entries() -> None:
    entry = {"keys": ["k"], "sizes": [1], "checksums": [0], "layer": 1}
    body = json.dumps({"request": "r", "layers": [entry] * (MAX_LAYERS + 1)}).encode()
    with pytest.raises(MalformedMessage, match=f"not a list of 1 to {MAX_LAYERS}"):
        Layers.decode(body, Limits(max_keys=8))


def test_adv_hold_an_async_consumer_reads_a_layers_message_as_its_blocks(nats, make_stream, pool) -> None:
    s = make_stream()
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        _publish(p, "as", range(3))
        p.end_request("as", 3)

    async def read() -> list[Any]:
        out = []
        async with AsyncConsumer(s, nats.url, pool=pool) as c:
            while (msg := await c.receive(1.0)) is not None:
                out.append((msg.kind, bytes(msg.data) if msg.kind != "end" else b""))
                await msg.ack()
        return out
    got = asyncio.run(read())
    assert [k for k, _ in got] == ["kv", "kv-layers", "end"]
    assert got[1][1] == _block("as", 1).tobytes() + _block("as", 2).tobytes()


def test_adv_hold_a_late_receiver_reads_stored_layers_messages_whole(nats, make_stream, pool) -> None:
    """Requests finished before the receiver exists: it reads their kv-layers messages back from the stream."""
    s = make_stream()
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        for request in ("late1", "late2"):
            _publish(p, request, range(11))
            p.end_request(request, 11)
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "late2") == list(range(11))
        assert _receive(rx, "late1") == list(range(11))
    assert rx.counts["rejected"] == 0 and rx.counts["recovered"] >= 4
