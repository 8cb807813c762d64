"""A receiver's purge goes on its `Wire` (`Wire.request`, `live.direct_last`, `live.purge_upto`), against
nats-server: a request answered once, one nobody serves, one unanswered; a request whose end came live
purged up to that end, with the stream serving direct gets and without; and JetStream's refusals typed."""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from kvpool.streams import HandoffReceiver, Producer, StreamNotFound, stream_info
from kvpool.streams._link import Link
from kvpool.streams.admin import StreamConfig, subject
from kvpool.streams.live import direct_last, purge_upto
from kvpool.streams.wire import Wire


def _answering(url: str, subj: str, after_s: float = 0.0) -> tuple[Wire, threading.Thread]:
    """A second Wire subscribed to `subj` whose thread takes one request and answers it `after_s` later."""
    server = Wire(url)
    sid = server.subscribe(subj)

    def serve() -> None:
        msg = server.next(sid, 10)
        if msg is not None:
            time.sleep(after_s)
            server.publish(msg.reply, b"re: " + msg.data)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return server, t


def test_a_request_gets_its_one_answer_and_leaves_no_subscription(nats):
    server, t = _answering(nats.url, "svc.echo")
    wire = Wire(nats.url)
    try:
        subs = dict(wire._subs)
        got = wire.request("svc.echo", b"hello", 5)
        assert got is not None and got.data == b"re: hello"
        assert wire._subs == subs and set(wire._queues) == set(subs)
        none = wire.request("svc.nobody", b"", 5)  # the server answers for a subject nobody serves
        assert none is not None and none.headers.get("Status") == "503"
        assert wire._subs == subs
    finally:
        t.join(10)
        wire.close()
        server.close()


def test_a_request_unanswered_in_time_is_none_and_its_late_answer_goes_nowhere(nats):
    server, t = _answering(nats.url, "svc.slow", after_s=0.6)
    wire = Wire(nats.url)
    try:
        subs = dict(wire._subs)
        assert wire.request("svc.slow", b"anyone?", 0.3) is None
        assert wire._subs == subs and set(wire._queues) == set(subs)
        t.join(10)  # the answer was sent after the request gave up
        wire.flush()  # (it read the late answer, which no queue took)
        assert set(wire._queues) == set(subs)
        got = wire.request("svc.nobody", b"", 5)  # the wire goes on working
        assert got is not None and got.headers.get("Status") == "503"
    finally:
        t.join(10)
        wire.close()
        server.close()


def test_jetstream_refusals_of_a_purge_are_typed(nats, make_stream):
    wire = Wire(nats.url)
    try:
        with pytest.raises(StreamNotFound):
            purge_upto(wire, "no-such-stream", subject("no-such-stream", "req", "r"), 5, 5)
        assert direct_last(wire, "no-such-stream", subject("no-such-stream", "req", "r"), 5) is False
        s = make_stream()
        assert direct_last(wire, s, subject(s, "req", "r"), 5) is None  # a stream holding nothing there
        assert purge_upto(wire, s, subject(s, "req", "r"), 5, 5) == 0
    finally:
        wire.close()


def _no_direct_gets(url: str, name: str) -> None:
    link = Link(url, role="admin")
    try:
        cfg = dataclasses.replace(StreamConfig(memory=True).to_nats(name), allow_direct=False)
        link.call(link.js.update_stream(cfg), "update")
    finally:
        link.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct-gets", "no-direct-gets"])
def test_a_request_whose_end_came_live_is_purged_up_to_its_end(nats, make_stream, pool, direct, monkeypatch):
    """The receiver subscribes first, so every message comes live (no stream sequence known): the purge
    finds the end's sequence, by a direct get where the stream serves them, through nats-py where not."""
    from kvpool.streams import handoff

    through_nats_py: list[str] = []
    real = handoff.stored_last

    def stored_last(link: Any, stream: str, subj: str) -> Any:
        through_nats_py.append(subj)
        return real(link, stream, subj)
    monkeypatch.setattr(handoff, "stored_last", stored_last)
    s = make_stream(memory=True)
    if not direct:
        _no_direct_gets(nats.url, s)
    with HandoffReceiver(s, nats.url, pool) as rx:
        def produce() -> None:
            time.sleep(0.5)  # the receiver is subscribed: the request comes live
            with Producer(s, nats.url, pool=pool) as p:
                for layer in range(3):
                    p.publish_kv("live", layer, [f"live/L{layer}"], [bytes([layer]) * 4096])
                p.end_request("live", 3)
        t = threading.Thread(target=produce, daemon=True)
        t.start()
        layers = []
        for layer, _keys, bufs in rx.iter_layers("live", timeout=20):
            layers.append((layer, bytes(bufs[0][:1])))
        t.join(20)
        assert rx.counts["recovered"] == 0  # every message came live
    assert layers == [(0, b"\x00"), (1, b"\x01"), (2, b"\x02")]
    assert bool(through_nats_py) is not direct
    assert stream_info(nats.url, s)["messages"] == 0  # (close waited for the purge)


def test_a_request_waiting_for_its_answer_gives_up_when_its_wire_is_closed(nats):
    """A receiver's close ends a purge still waiting for JetStream: the thread polling the socket wakes
    at the close (a shutdown), not at its request's timeout."""
    silent = Wire(nats.url)
    silent.subscribe("svc.never")  # takes the request, never answers
    wire = Wire(nats.url)
    time.sleep(2.5)  # (past the server's first PING to a new connection, which would wake the poll too)
    done: dict[str, float] = {}

    def ask() -> None:
        assert wire.request("svc.never", b"?", 20) is None
        done["at"] = time.monotonic()
    t = threading.Thread(target=ask, daemon=True)
    try:
        t.start()
        time.sleep(0.3)  # waiting for the answer
        closed = time.monotonic()
        wire.close()
        t.join(20)
        assert "at" in done and done["at"] - closed < 5, "the request waited on after its wire was closed"
    finally:
        silent.close()
