"""The handoff's notification path: each message taken live from core NATS the moment it is published,
the stream's stored copy read back where the live path lost one. Real nats-server and `kvpool worker`.
The producers here announce each layer in a message of its own (`hold_s=0`), so that a test can lose,
reorder or fail the message of one layer; tests/streams/test_layer_hold.py has layers that go together."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvpool.core import PoolClient, nats_connect
from kvpool.streams import HandoffReceiver, Producer, live, stream_info

LAYERS, BLOCK = 6, 64 << 10


def _block(request: str, layer: int) -> np.ndarray:
    return np.random.default_rng([sum(request.encode()), layer]).integers(0, 256, BLOCK, dtype=np.uint8)



def forge_end(url: str, subject: str, request: str) -> None:
    """Publish an unsigned `end` claiming `request` has one layer, as anyone allowed on the subject could."""
    async def run() -> None:
        nc = await nats_connect(url, 5, logging.getLogger("test.forger"))
        try:
            await nc.publish(subject, json.dumps({"request": request, "layers": 1}).encode(),
                             headers={"Kvpool-Kind": "end"})
            await nc.flush()
        finally:
            await nc.close()
    asyncio.run(run())


def _layer_of(msg: Any) -> int | None:
    """The layer a live kv message announces; None for an end."""
    return json.loads(msg.data)["layer"] if (msg.headers or {}).get("Kvpool-Kind") == "kv" else None


def _live_filter(monkeypatch: pytest.MonkeyPatch, keep: Callable[[Any], bool]) -> list[Any]:
    """Make every receiver's live path lose the messages `keep` refuses; returns those lost."""
    lost: list[Any] = []
    real = live.Feed._on_live

    def on_live(self: live.Feed, msg: Any) -> None:
        if keep(msg):
            real(self, msg)
        else:
            lost.append(msg)
    monkeypatch.setattr(live.Feed, "_on_live", on_live)
    return lost


def _handoff(nats_url: str, stream: str, pool: PoolClient, request: str, *, secret: str | None = None,
             gate: threading.Event | None = None, stored: threading.Event | None = None,
             hold_s: float = 0.0) -> threading.Thread:
    """A producer thread publishing LAYERS layers of `request` and its end; with `gate`, it publishes
    layer 0, sets `stored` once the stream has it, and waits (at most 20 s) for the gate before the rest."""
    def run() -> None:
        with Producer(stream, nats_url, pool=pool, secret=secret, hold_s=hold_s) as p:
            for layer in range(LAYERS):
                p.publish_kv(request, layer, [f"{request}/L{layer}"], [_block(request, layer)])
                if layer == 0 and gate is not None:
                    p.flush()
                    if stored is not None:
                        stored.set()
                    gate.wait(20)
            p.end_request(request, LAYERS)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _receive(rx: HandoffReceiver, request: str, on_layer: Callable[[int], None] = lambda layer: None) -> list[int]:
    got = []
    for layer, keys, bufs in rx.iter_layers(request, timeout=20):
        assert keys == [f"{request}/L{layer}"]
        assert bytes(bufs[0]) == _block(request, layer).tobytes()
        got.append(layer)
        on_layer(layer)
    return got


def test_layer_0_is_usable_before_the_producer_publishes_layer_1(nats, make_stream, pool):
    s, gate = make_stream(), threading.Event()
    with HandoffReceiver(s, nats.url, pool) as rx:
        producer = _handoff(nats.url, s, pool, "first", gate=gate)
        got = _receive(rx, "first", lambda layer: gate.set() if layer == 0 else None)
    producer.join(20)
    assert got == list(range(LAYERS))
    # all of it live, every block read from the worker's shared memory (the producer's node)
    assert rx.counts == {"rejected": 0, "recovered": 0, "in_place": LAYERS, "from_pool": 0}


@pytest.mark.parametrize("lose", [[2], [0], [3, 4], [None]], ids=["layer-2", "layer-0", "layers-3-4", "end"])
def test_a_lost_live_notification_is_read_back_from_the_stream_in_order(nats, make_stream, pool, monkeypatch, lose):
    s = make_stream()
    lost = _live_filter(monkeypatch, lambda msg: _layer_of(msg) not in lose)
    with HandoffReceiver(s, nats.url, pool) as rx:
        producer = _handoff(nats.url, s, pool, "lossy")
        got = _receive(rx, "lossy")
    producer.join(20)
    assert [_layer_of(m) for m in lost] == lose
    assert got == list(range(LAYERS))
    assert rx.counts["rejected"] == 0 and rx.counts["recovered"] >= len(lose)
    assert stream_info(nats.url, s)["messages"] == 0   # the request's messages, its end too, purged: acked


def test_live_messages_out_of_order_are_yielded_in_the_producers_order(nats, make_stream, pool, monkeypatch):
    s, held = make_stream(), []
    real = live.Feed._on_live

    def reorder(self: live.Feed, msg: Any) -> None:
        if _layer_of(msg) == 1:  # layer 1 held back until layer 3 went through
            held.append(msg)
            return
        real(self, msg)
        if _layer_of(msg) == 3:
            real(self, held.pop())
    monkeypatch.setattr(live.Feed, "_on_live", reorder)
    with HandoffReceiver(s, nats.url, pool) as rx:
        producer = _handoff(nats.url, s, pool, "shuffled")
        got = _receive(rx, "shuffled")
    producer.join(20)
    assert got == list(range(LAYERS))
    assert rx.counts["rejected"] == 0


def test_a_late_receiver_takes_the_stored_messages_then_the_live_ones_each_once(nats, make_stream, pool):
    s, gate, stored = make_stream(), threading.Event(), threading.Event()
    producer = _handoff(nats.url, s, pool, "late", gate=gate, stored=stored)
    assert stored.wait(20)
    with HandoffReceiver(s, nats.url, pool) as rx:
        got = _receive(rx, "late", lambda layer: gate.set() if layer == 0 else None)
    producer.join(20)
    assert got == list(range(LAYERS))
    assert rx.counts["rejected"] == 0 and rx.counts["recovered"] >= 1   # layer 0 was stored before we came


def _counting_gets(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the one-message reads of a stream (`live._get`): a batched read-back makes none."""
    calls: list[int] = []
    real = live._get

    async def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return await real(*a, **kw)
    monkeypatch.setattr(live, "_get", counted)
    return calls


def test_a_request_published_whole_before_the_receiver_came_is_read_back(nats, make_stream, pool, monkeypatch):
    s = make_stream()
    _handoff(nats.url, s, pool, "early").join(20)  # layers and end stored; nothing will come live
    gets = _counting_gets(monkeypatch)
    t = time.monotonic()
    with HandoffReceiver(s, nats.url, pool) as rx:
        got = _receive(rx, "early")
    assert got == list(range(LAYERS)) and rx.counts["recovered"] == LAYERS + 1
    assert time.monotonic() - t < 2  # read back after a first look for live ones, not after a timeout
    assert gets == []  # in one batched request (a direct get), not one request per message


def test_a_stream_without_direct_gets_is_read_back_a_message_at_a_time(nats, make_stream, pool, monkeypatch):
    """A stream made before streams allowed direct gets (or by other tools) answers the batched read
    with no responder: the receiver reads it one message per request, as it did before."""
    from nats.js import api

    from kvpool.streams._link import Link

    link = Link(nats.url, role="admin")
    try:
        link.call(link.js.add_stream(api.StreamConfig(name="plain", subjects=["kvpool.stream.plain.>"],
                                                      storage=api.StorageType.MEMORY)), "add a stream")
    finally:
        link.close()
    _handoff(nats.url, "plain", pool, "early").join(20)
    gets = _counting_gets(monkeypatch)
    with HandoffReceiver("plain", nats.url, pool) as rx:
        got = _receive(rx, "early")
    assert got == list(range(LAYERS)) and rx.counts["recovered"] == LAYERS + 1
    assert len(gets) >= LAYERS + 1


def test_a_forged_live_end_is_dropped_with_a_secret(nats, make_stream, pool, monkeypatch):
    """The receiver is waiting (the live path) when a forger who cannot sign publishes an `end`."""
    monkeypatch.setenv("KVPOOL_STREAM_SECRET", "live-secret")
    s, gate = make_stream(), threading.Event()
    with HandoffReceiver(s, nats.url, pool) as rx:
        producer = _handoff(nats.url, s, pool, "signed", gate=gate)

        def after(layer: int) -> None:
            if layer == 0:
                forge_end(nats.url, f"kvpool.stream.{s}.req.signed", "signed")
                gate.set()
        got = _receive(rx, "signed", after)
    producer.join(20)
    assert got == list(range(LAYERS))
    assert rx.counts["rejected"] >= 1


def test_what_was_published_while_the_receiver_reconnected_is_read_back(nats, make_stream, pool):
    """NATS restarts mid-request (the stream is on disk): the receiver's connection comes back on its
    own, and the layers published before its subscription did are read back from the stream."""
    from kvpool.core.nats_server import NatsServer
    from kvpool.streams import StreamUnavailable

    s, restarted, servers = make_stream(), threading.Event(), []

    def produce() -> None:
        with Producer(s, nats.url, pool=pool, timeout_s=2, hold_s=0) as p:
            p.publish_kv("restart", 0, ["restart/L0"], [_block("restart", 0)])
            p.flush()
            assert restarted.wait(30)
            deadline = time.monotonic() + 20
            for layer in range(1, LAYERS):
                while True:
                    try:
                        p.publish_kv("restart", layer, [f"restart/L{layer}"], [_block("restart", layer)])
                        p.flush()
                        break
                    except StreamUnavailable:  # the producer's own connection is still coming back
                        assert time.monotonic() < deadline
                        time.sleep(0.1)
            p.end_request("restart", LAYERS)

    def restart(layer: int) -> None:
        if layer == 0:
            nats.stop()
            servers.append(NatsServer(nats.store_dir, port=nats.port).start())
            assert pool.wait_for_members(lambda m: len(m) == 1, 20)
            restarted.set()

    with HandoffReceiver(s, nats.url, pool, timeout_s=2) as rx:
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        try:
            got = _receive(rx, "restart", restart)
        finally:
            restarted.set()
            producer.join(30)
            for server in servers:
                server.stop()
    assert got == list(range(LAYERS))
    assert rx.counts["rejected"] == 0


def test_a_receiver_on_a_missing_stream_fails_at_once(nats, pool):
    from kvpool.streams import StreamNotFound

    with HandoffReceiver("nosuchstream", nats.url, pool) as rx, pytest.raises(StreamNotFound):
        next(iter(rx.iter_layers("r", timeout=5)))


def test_copies_of_one_message_waiting_ahead_of_their_place_count_once(nats, make_stream, pool, monkeypatch):
    """Layer 1 lost live, layer 2 delivered live twice (as a read-back would): once the stream gives
    layer 1 back, layer 2 is taken once and its copy is not counted as forged."""
    s = make_stream()
    real = live.Feed._on_live

    def twice(self: live.Feed, msg: Any) -> None:
        if _layer_of(msg) == 1:
            return
        real(self, msg)
        if _layer_of(msg) == 2:
            real(self, msg)
    monkeypatch.setattr(live.Feed, "_on_live", twice)
    with HandoffReceiver(s, nats.url, pool) as rx:
        producer = _handoff(nats.url, s, pool, "twice")
        got = _receive(rx, "twice")
    producer.join(20)
    assert got == list(range(LAYERS))
    assert rx.counts["rejected"] == 0 and rx.counts["recovered"] >= 1


def test_a_request_read_whole_is_not_failed_by_a_purge_that_fails(nats, make_stream, pool, monkeypatch, caplog):
    """Purging the request's messages is housekeeping: every layer is already in the decode side's hands."""
    from kvpool.streams import StreamTimeout

    def purge_fails(*_: Any) -> None:
        raise StreamTimeout("purge request: timed out")

    monkeypatch.setattr(HandoffReceiver, "_purge", purge_fails)
    s = make_stream()
    _handoff(nats.url, s, pool, "kept").join(20)
    with caplog.at_level(logging.WARNING, "kvpool.streams"), HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "kept") == list(range(LAYERS))
    assert "read whole, but its messages were not purged" in caplog.text


def _slow_purges(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Make every JetStream purge take 0.5 s more; returns when each purge was sent (monotonic seconds)."""
    from kvpool.streams import handoff

    real = handoff.purge_upto
    purges: list[float] = []

    def slow_purge(*args: Any, **kwargs: Any) -> int:
        time.sleep(0.5)
        purges.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(handoff, "purge_upto", slow_purge)
    return purges


def test_the_purge_is_housekeeping_the_caller_does_not_wait_for_but_close_does(nats, make_stream, pool, monkeypatch):
    """The request's messages are purged in the background: the decode side's loop over the layers ends
    with the last of them, not after two more round trips to JetStream; closing the receiver waits."""
    purges = _slow_purges(monkeypatch)
    s = make_stream()
    _handoff(nats.url, s, pool, "tidy").join(20)
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "tidy") == list(range(LAYERS))
        returned = time.monotonic()
        assert purges == []  # under way
    assert len(purges) == 1 and purges[0] > returned  # close waited for it
    assert stream_info(nats.url, s)["messages"] == 0


def test_purges_under_way_are_bounded(nats, make_stream, pool, monkeypatch):
    """With `_PURGING` purges under way, a request's end waits for one of them: a JetStream slower than
    the requests end builds no queue without bound."""
    from kvpool.streams import handoff

    purges = _slow_purges(monkeypatch)
    monkeypatch.setattr(handoff, "_PURGING", 1)
    s = make_stream()
    for r in ("one", "two"):
        _handoff(nats.url, s, pool, r).join(20)
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert _receive(rx, "one") == list(range(LAYERS))
        assert _receive(rx, "two") == list(range(LAYERS))
        assert len(purges) == 1  # the second request's end waited for the first purge, not for its own
    assert len(purges) == 2
    assert stream_info(nats.url, s)["messages"] == 0


def test_a_receiver_whose_nats_is_gone_gives_up_near_its_own_timeout(nats, make_stream, pool):
    """The NATS server goes while a receiver waits: its read-backs are bounded by what is left of the
    caller's timeout (at least LOOK_S), not by the connection's 5 s: an engine asking for 1 s hears back
    in about that."""
    from kvpool.streams import StreamUnavailable, handoff

    s = make_stream()
    with HandoffReceiver(s, nats.url, pool) as rx:
        stop = threading.Timer(0.3, nats.stop)
        stop.start()
        t = time.monotonic()
        with pytest.raises((TimeoutError, StreamUnavailable)):
            next(iter(rx.iter_layers("gone", timeout=1.0)))
        waited = time.monotonic() - t
        stop.join()
    assert waited < 1.0 + 3 * handoff.LOOK_S, f"gave up after {waited:.2f} s"


def test_a_read_back_cut_short_keeps_what_it_took(nats, make_stream, pool, monkeypatch):
    """A bounded read-back that runs out of time returns the messages it took; the next one goes on
    from there: none lost, none twice, in stream order."""
    from kvpool.streams import StreamTimeout
    from kvpool.streams._link import Link
    from kvpool.streams.wire import Wire

    s = make_stream()
    _handoff(nats.url, s, pool, "slow").join(20)
    real = live._get

    async def slow_get(*a: Any, **kw: Any) -> Any:
        await asyncio.sleep(0.1)
        return await real(*a, **kw)

    link, wire = Link(nats.url), Wire(nats.url)
    try:
        feed = live.Feed(link, wire, s, f"kvpool.stream.{s}.req.slow")
        feed._direct = False  # the read a message at a time (a batched one takes them in one answer)
        monkeypatch.setattr(live, "_get", slow_get)
        with pytest.raises(StreamTimeout):
            feed.stored(0.05)  # cut short before the first message: nothing taken, an error
        first = feed.stored(0.35)
        monkeypatch.setattr(live, "_get", real)
        rest = feed.stored()
        feed.close()
    finally:
        wire.close()
        link.close()
    assert 1 <= len(first) < LAYERS + 1
    seqs = [m.seq for m in first + rest]
    assert seqs == sorted(set(seqs)) and len(seqs) == LAYERS + 1  # every layer and the end, once each


def test_a_layer_or_end_whose_send_failed_is_published_again_and_taken_once(nats, make_stream, pool, monkeypatch):
    """A publish_kv or end_request that raised (NATS unreachable: the send failed) announced nothing: the
    producer calls it again and the receiver takes each layer and the end once, in one chain."""
    from kvpool.streams import StreamUnavailable
    from kvpool.streams.wire import Wire

    s, failed = make_stream(), []
    real = Wire.publish

    def flaky(self: Wire, subj: str, body: bytes, headers: dict[str, str] | None = None, reply: str = "") -> None:
        kind = (headers or {}).get("Kvpool-Kind")
        which = "end" if kind == "end" else json.loads(body)["layer"] if kind == "kv" else None
        if which in (2, "end") and which not in failed:
            failed.append(which)
            raise StreamUnavailable("NATS at nats://test: sending failed twice (injected)")
        real(self, subj, body, headers, reply)

    monkeypatch.setattr(Wire, "publish", flaky)

    def again(call: Callable[..., object], *args: object) -> None:
        try:
            call(*args)
        except StreamUnavailable:
            call(*args)

    def produce() -> None:
        with Producer(s, nats.url, pool=pool, timeout_s=5, hold_s=0) as p:
            for layer in range(LAYERS):
                again(p.publish_kv, "again", layer, [f"again/L{layer}"], [_block("again", layer)])
            again(p.end_request, "again", LAYERS)

    with HandoffReceiver(s, nats.url, pool) as rx:
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        got = _receive(rx, "again")
        producer.join(20)
    assert failed == [2, "end"]
    assert got == list(range(LAYERS))
    assert rx.counts["rejected"] == 0
