"""A request's layers that come together are announced together (`layer_hold`, `kv-layers` messages):
when they wait and when they go, what the decode side and a plain consumer make of such a message, and
that losing, failing or forging one costs a read-back or a typed error, never a layer. Real nats-server
and `kvpool worker`."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import numpy as np
import pytest
from handoffhelp import forge, layer_block, receive_layers

from kvpool.core import ConfigError, PoolClient
from kvpool.streams import Consumer, HandoffError, HandoffReceiver, Producer, StreamUnavailable, live, stream_info
from kvpool.streams.envelope import MAX_LAYERS, Layers, Limits, Ref
from kvpool.streams.errors import MalformedMessage
from kvpool.streams.layer_hold import HOLD_BYTES, HOLD_KEYS, HOLD_LAYERS, LayerHold
from kvpool.streams.payload import put_blocks
from kvpool.streams.sealing import Sealer
from kvpool.streams.wire import Wire

BLOCK = 64 << 10
LAYERS = HOLD_LAYERS + 2  # the first alone, a full message, one sent by the end
CHAIN = Sealer()
"""The chain LayerHold's unit tests hand it (its layers are not sent there)."""
LONG_S = 0.5
"""A hold far longer than a test's layers take to come, so that which go together does not depend on
the machine's speed."""


def _block(request: str, layer: int) -> np.ndarray:
    return layer_block(request, layer, BLOCK)


def _publish(p: Producer, request: str, layers: range) -> None:
    for layer in layers:
        p.publish_kv(request, layer, [f"{request}/L{layer}"], [_block(request, layer)])


def _kinds(url: str, stream: str, pool: PoolClient) -> list[str]:
    """The kind of every message the stream holds, in order."""
    got: list[str] = []
    with Consumer(stream, url, pool=pool) as c:
        while (msg := c.receive(1.0)) is not None:
            got.append(msg.kind)
            msg.ack()
    return got


def _receive(rx: HandoffReceiver, request: str, timeout: float = 20) -> list[int]:
    return receive_layers(rx, request, BLOCK, timeout)


def _ref(layer: int, n: int = 1) -> Ref:
    return Ref([f"r/L{layer}/{i}" for i in range(n)], [8] * n, [layer] * n, "r", layer)


def _entry(layer: int, n: int = 1) -> dict[str, Any]:
    """A layer as a layers message lists it (no request of its own)."""
    return {k: v for k, v in _ref(layer, n).body().items() if k != "request"}


# -- when layers wait, and when they go -------------------------------------------------------------

def test_a_requests_first_layer_goes_at_once_and_fast_ones_wait_for_a_full_message() -> None:
    hold = LayerHold(hold_s=LONG_S)
    assert not hold.add("r", "s", CHAIN, _ref(0), 0.0)  # the first: the decode side waits for it
    hold.clear()
    waits = [hold.add("r", "s", CHAIN, _ref(layer), 0.001 * layer) for layer in range(1, HOLD_LAYERS + 1)]
    assert waits == [True] * (HOLD_LAYERS - 1) + [False]  # the message is full: all of them go
    assert [r.layer for r in hold.refs] == list(range(1, HOLD_LAYERS + 1))


def test_layers_slower_than_the_hold_go_each_at_once() -> None:
    hold = LayerHold(hold_s=0.002)
    assert not hold.add("r", "s", CHAIN, _ref(0), 0.0)
    hold.clear()
    assert not hold.add("r", "s", CHAIN, _ref(1), 0.003)
    hold.clear()
    assert hold.add("r", "s", CHAIN, _ref(2), 0.0035)  # 0.5 ms after the one before: the next may come soon
    assert not hold.add("r", "s", CHAIN, _ref(3), 0.0050)  # the next, 1.5 ms on, would find layer 2 waiting 3 ms
    assert LayerHold(hold_s=0).add("r", "s", CHAIN, _ref(0), 0.0) is False


def test_a_layer_of_another_request_or_past_the_key_bound_does_not_wait_with_them() -> None:
    hold = LayerHold(hold_s=LONG_S)
    hold.add("a", "sa", CHAIN, _ref(0), 0.0)
    hold.clear()
    assert hold.add("a", "sa", CHAIN, _ref(1), 0.001)
    assert not hold.fits("b", _ref(0)) and hold.fits("a", _ref(2, HOLD_KEYS - 1))
    assert not hold.fits("a", _ref(2, HOLD_KEYS))  # past the bound on blocks: those waiting go first
    big = Ref(["a/L2"], [HOLD_BYTES], [0], "a", 2)
    assert not hold.fits("a", big)  # past the bound on bytes
    assert not hold.add("a", "sa", CHAIN, _ref(2, HOLD_KEYS - 1), 0.002)  # the blocks named reach the bound: go
    hold.drop_last()  # (its call raised: it is published again later)
    assert [r.layer for r in hold.refs] == [1] and hold.fits("a", _ref(2, HOLD_KEYS - 1))
    alone = LayerHold(hold_s=LONG_S)
    assert alone.fits("a", big) and not alone.add("a", "sa", CHAIN, big, 0.0)  # a large layer goes alone, at once


def test_hold_s_outside_0_to_1_s_is_a_config_error(nats, make_stream, pool) -> None:
    s = make_stream()
    for bad in (-0.001, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="hold_s"):
            Producer(s, nats.url, pool=pool, hold_s=bad)


# -- the wire form ----------------------------------------------------------------------------------

def test_a_layers_message_reads_back_as_the_layers_it_names() -> None:
    seal = Sealer().next()
    sent = Layers("r", [_ref(3, 2), _ref(4)], seal)
    got = Layers.decode(sent.encode())
    assert got == sent
    merged = got.merged()
    assert (merged.keys, merged.sizes, merged.checksums, merged.layer) == (
        ["r/L3/0", "r/L3/1", "r/L4/0"], [8, 8, 8], [3, 3, 4], 3)


def test_a_plain_consumer_bounds_a_layers_message_as_one_payload() -> None:
    """A receiver bounds each layer; a plain consumer, which reads the message as one payload, bounds the
    whole of it (before it allocates a buffer for it)."""
    two = Layers("r", [_ref(0, 3), _ref(1, 3)], Sealer().next())
    assert len(two.merged(Limits(max_keys=6)).keys) == 6
    with pytest.raises(MalformedMessage, match="6 blocks, 48 bytes"):
        two.merged(Limits(max_keys=5))
    with pytest.raises(MalformedMessage, match="6 blocks, 48 bytes"):
        two.merged(Limits(max_bytes=47))


@pytest.mark.parametrize("body, why", [
    ({"request": "r", "layers": []}, "not a list of 1 to"),
    ({"request": "r", "layers": {"a": 1}}, "not a list of 1 to"),
    ({"request": "r", "layers": [{"keys": ["k"], "sizes": [1], "checksums": [0]}]}, "with a layer"),
    ({"request": "r", "layers": [{**_entry(0), "request": "other"}]}, "no request or seal"),
    ({"request": "r", "layers": [{**_entry(0), "seal": {}}]}, "no request or seal"),
    ({"request": "r", "layers": [{**_entry(0), "layer": -1}]}, "layer is -1"),
    ({"request": "no spaces", "layers": [_entry(0)]}, "request id"),
    ({"request": "r", "layers": [_entry(0), _entry(1, 5)]}, "reference names 5 blocks"),
    ({"request": "r", "layers": [_entry(0), {**_entry(1, 2), "sizes": [1 << 20, 1 << 20]}]},
     "reference names 2097152 bytes"),
    ({"request": "r", "layers": [_entry(i) for i in range(MAX_LAYERS + 1)]}, f"not a list of 1 to {MAX_LAYERS}"),
], ids=["empty", "not-a-list", "no-layer", "own-request", "own-seal", "negative-layer", "bad-request",
        "a-layer-past-max-keys", "a-layer-past-max-bytes", "too-many-layers"])
def test_a_malformed_layers_message_is_refused_before_anything_is_allocated(body: dict[str, Any], why: str) -> None:
    """`limits` bound each layer (as they bound a `kv` message's one); the list, `MAX_LAYERS`."""
    limits = Limits(max_block=1 << 20, max_keys=4, max_bytes=3 << 19)
    with pytest.raises(MalformedMessage, match=why):
        Layers.decode(json.dumps(body).encode(), limits)


# -- producer to decode side ------------------------------------------------------------------------

def test_fast_layers_go_in_fewer_messages_and_arrive_whole_and_in_order(nats, make_stream, pool) -> None:
    s = make_stream()
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        _publish(p, "r", range(LAYERS))
        p.end_request("r", LAYERS)
    # layer 0 alone, 1 to HOLD_LAYERS in one message, the last sent by the end (which goes after it)
    assert _kinds(nats.url, s, pool) == ["kv", "kv-layers", "kv", "end"]
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "r") == list(range(LAYERS))
    assert rx.counts["rejected"] == 0 and rx.counts["in_place"] == LAYERS


def test_layers_left_waiting_go_within_the_hold_without_another_call(nats, make_stream, pool) -> None:
    s, hold_s = make_stream(), 0.2
    with Producer(s, nats.url, pool=pool, hold_s=hold_s) as p:
        _publish(p, "r", range(3))  # layer 0 goes, layers 1 and 2 wait: no call comes after them
        t = time.monotonic()
        deadline = t + 10
        while stream_info(nats.url, s)["messages"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        waited = time.monotonic() - t
        assert stream_info(nats.url, s)["messages"] == 2, "the held layers were not announced by the alarm"
        assert waited < 2  # (the alarm's 0.2 s, and a loaded machine's slack)
        p.end_request("r", 3)
    assert _kinds(nats.url, s, pool) == ["kv", "kv-layers", "end"]


def _lose_live(monkeypatch: pytest.MonkeyPatch, kind: str) -> list[Any]:
    lost: list[Any] = []
    real = live.Feed._on_live

    def on_live(self: live.Feed, msg: Any) -> None:
        if (msg.headers or {}).get("Kvpool-Kind") == kind and not lost:
            lost.append(msg)
        else:
            real(self, msg)
    monkeypatch.setattr(live.Feed, "_on_live", on_live)
    return lost


def test_a_lost_layers_message_is_read_back_from_the_stream(nats, make_stream, pool, monkeypatch) -> None:
    s = make_stream()
    lost = _lose_live(monkeypatch, "kv-layers")
    with HandoffReceiver(s, nats.url, pool) as rx:
        def produce() -> None:
            with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
                _publish(p, "lossy", range(LAYERS))
                p.end_request("lossy", LAYERS)
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        got = _receive(rx, "lossy")
        producer.join(20)
    assert len(lost) == 1 and got == list(range(LAYERS))
    assert rx.counts["rejected"] == 0 and rx.counts["recovered"] >= 1


def test_a_layers_message_whose_send_failed_goes_with_the_call_made_again(nats, make_stream, pool,
                                                                          monkeypatch) -> None:
    """The send of the full message (layers 1 to HOLD_LAYERS) fails at its last layer's call: that call
    raises, the layers before (whose calls returned) wait on, and the call made again sends them all, each
    taken once."""
    s, failed = make_stream(), []
    real = Wire.publish

    def flaky(self: Wire, subj: str, body: bytes, headers: dict[str, str] | None = None, reply: str = "") -> None:
        if (headers or {}).get("Kvpool-Kind") == "kv-layers" and not failed:
            failed.append([layer["layer"] for layer in json.loads(body)["layers"]])
            raise StreamUnavailable("NATS at nats://test: sending failed (injected)")
        real(self, subj, body, headers, reply)
    monkeypatch.setattr(Wire, "publish", flaky)
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        _publish(p, "again", range(HOLD_LAYERS))
        with pytest.raises(StreamUnavailable):
            _publish(p, "again", range(HOLD_LAYERS, HOLD_LAYERS + 1))
        _publish(p, "again", range(HOLD_LAYERS, LAYERS))
        p.end_request("again", LAYERS)
    assert failed == [list(range(1, HOLD_LAYERS + 1))]
    assert _kinds(nats.url, s, pool) == ["kv", "kv-layers", "kv", "end"]
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "again") == list(range(LAYERS))
    assert rx.counts["rejected"] == 0


def test_a_plain_consumer_reads_a_layers_message_as_its_blocks_in_order(nats, make_stream, pool) -> None:
    s = make_stream()
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        _publish(p, "r", range(3))
        p.end_request("r", 3)
    with Consumer(s, nats.url, pool=pool) as c:
        msgs = []
        while (msg := c.receive(1.0)) is not None:
            msgs.append(msg)
            msg.ack()
    assert [m.kind for m in msgs] == ["kv", "kv-layers", "end"]
    assert bytes(msgs[1].data) == _block("r", 1).tobytes() + _block("r", 2).tobytes()
    assert msgs[1].ref is not None and msgs[1].ref.keys == ["r/L1", "r/L2"]


def test_a_layer_named_twice_in_a_layers_message_fails_the_request(nats, make_stream, pool: PoolClient) -> None:
    """A chain of its own (a buggy or compromised producer) whose layers message names layer 1 twice: a
    typed error, never a short or doubled read."""
    s, chain = make_stream(), Sealer()
    refs = [put_blocks(pool, [f"dup/L{layer}"], [_block("dup", layer)], request="dup", layer=layer) for layer in (0, 1)]
    subj = f"kvpool.stream.{s}.req.dup"
    body = Layers("dup", [refs[0], refs[1], dataclasses.replace(refs[1])], chain.next()).encode()
    forge(nats.url, [(subj, body, {"Kvpool-Kind": "kv-layers"})])
    with HandoffReceiver(s, nats.url, pool) as rx, pytest.raises(HandoffError, match="layer 1 twice"):
        list(rx.iter_layers("dup", timeout=5))


def test_interleaved_requests_each_arrive_whole(nats, make_stream, pool) -> None:
    """Layers of two requests in turns (an engine saving a layer for each request of a batch): a layer
    of one sends the other's waiting layers first, and each receiver takes its own request whole."""
    s = make_stream()
    with Producer(s, nats.url, pool=pool, hold_s=LONG_S) as p:
        for layer in range(3):
            for request in ("a", "b"):
                _publish(p, request, range(layer, layer + 1))
        p.end_request("a", 3)
        p.end_request("b", 3)
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "a") == [0, 1, 2] and _receive(rx, "b") == [0, 1, 2]
    assert rx.counts["rejected"] == 0


def test_layers_whose_send_failed_on_the_alarm_go_when_it_tries_again(nats, make_stream, pool, monkeypatch,
                                                                      caplog) -> None:
    """The alarm's send of the waiting layers fails (NATS away for a moment) and no call comes after: the
    alarm tries again, and the decode side gets them before the request's end is even asked for."""
    s, failed = make_stream(), []
    real = Wire.publish

    def flaky(self: Wire, subj: str, body: bytes, headers: dict[str, str] | None = None, reply: str = "") -> None:
        if (headers or {}).get("Kvpool-Kind") == "kv-layers" and not failed:
            failed.append(threading.current_thread().name)
            raise StreamUnavailable("NATS at nats://test: sending failed (injected)")
        real(self, subj, body, headers, reply)
    monkeypatch.setattr(Wire, "publish", flaky)
    with Producer(s, nats.url, pool=pool, hold_s=0.2) as p:
        _publish(p, "r", range(3))  # layer 0 goes; 1 and 2 wait, and no call comes
        deadline = time.monotonic() + 10
        while stream_info(nats.url, s)["messages"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failed == ["kvpool-announce"]  # (the alarm's send failed, not a call's)
        assert stream_info(nats.url, s)["messages"] == 2, "the alarm did not try again"
        p.end_request("r", 3)
    assert _kinds(nats.url, s, pool) == ["kv", "kv-layers", "end"]
    assert "announcing held layers failed" in caplog.text
