"""Adversarial checks of a handoff receiver's purges on a Wire of their own (`HandoffReceiver._purge_now`,
`Wire.request`, `live.direct_last`, `live.purge_upto`), against a real nats-server: a purge never takes
a later request of the same id; a nats-server restarted between purges; close and garbage collection
while a purge waits on a paused server; a stream deleted under a purge; many requests ending at once;
a secured server; a Wire read by another thread while it makes requests."""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from kvpool.core.nats_creds import authorization, ensure_creds
from kvpool.core.nats_server import NatsServer
from kvpool.streams import HandoffReceiver, Producer, StreamConfig, create_stream, delete_stream, handoff, stream_info
from kvpool.streams._link import Link
from kvpool.streams.wire import Wire

from sigstop import freeze

BLOCK = 4096


def _until(cond: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while True:
        try:
            if cond():
                return True
        except Exception:  # (a server not serving yet)
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _messages(url: str, stream: str) -> int:
    return int(stream_info(url, stream)["messages"])


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _purge_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvpool-purge") and t.is_alive()]


def _not_purged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not purged" in r.getMessage()]


def _read_live(rx: HandoffReceiver, url: str, stream: str, rid: str, delay: float = 0.2) -> list[Any]:
    """Read request `rid` (no layers) whose end is published `delay` s after the receiver subscribed: it
    comes live (no stream sequence known), so the purge looks the end up."""
    def produce() -> None:
        time.sleep(delay)
        with Producer(stream, url) as p:
            p.end_request(rid, 0)
    t = threading.Thread(target=produce, daemon=True)
    t.start()
    try:
        return list(rx.iter_layers(rid, timeout=5))
    finally:
        t.join(10)


def _no_direct_gets(url: str, name: str) -> None:
    link = Link(url, role="admin")
    try:
        cfg = dataclasses.replace(StreamConfig().to_nats(name), allow_direct=False)
        link.call(link.js.update_stream(cfg), "update")
    finally:
        link.close()


# -- a purge never takes a later request of the same id ------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct-gets", "no-direct-gets"])
def test_a_later_request_of_the_same_id_stored_before_the_purge_looks_survives_it(nats, make_stream, pool,
                                                                                  monkeypatch, direct):
    s = make_stream()
    if not direct:
        _no_direct_gets(nats.url, s)
    b_stored = threading.Event()
    real = handoff.direct_last

    def late_look(*a: Any, **kw: Any) -> Any:  # the purge looks only once B is stored whole
        b_stored.wait(10)
        return real(*a, **kw)
    monkeypatch.setattr(handoff, "direct_last", late_look)
    seqs: dict[str, int] = {}

    def produce() -> None:
        time.sleep(0.3)  # the receiver is subscribed: A comes live
        with Producer(s, nats.url, pool=pool) as p1:
            for layer in range(2):
                p1.publish_kv("dup", layer, [f"A/L{layer}"], [bytes([10 + layer]) * BLOCK])
            seqs["a_end"] = p1.end_request("dup", 2)
        with Producer(s, nats.url, pool=pool) as p2:
            for layer in range(3):
                p2.publish_kv("dup", layer, [f"B/L{layer}"], [bytes([20 + layer]) * BLOCK])
            seqs["b_end"] = p2.end_request("dup", 3)
        b_stored.set()

    t = threading.Thread(target=produce, daemon=True)
    with HandoffReceiver(s, nats.url, pool, timeout_s=2) as rx:
        t.start()
        got_a = [(layer, bytes(bufs[0][:1])) for layer, _, bufs in rx.iter_layers("dup", timeout=10)]
        t.join(15)
    assert got_a == [(0, b"\x0a"), (1, b"\x0b")]
    info = stream_info(nats.url, s)
    # A's messages (up to and with its end) gone, every one of B's kept
    assert (info["first_seq"], info["messages"]) == (seqs["a_end"] + 1, seqs["b_end"] - seqs["a_end"]), info
    monkeypatch.setattr(handoff, "direct_last", real)
    with HandoffReceiver(s, nats.url, pool, timeout_s=2) as rx2:
        got_b = [(layer, bytes(bufs[0][:1])) for layer, _, bufs in rx2.iter_layers("dup", timeout=5)]
    assert got_b == [(0, b"\x14"), (1, b"\x15"), (2, b"\x16")]


# -- a nats-server restarted between purges -------------------------------------------------------------


def test_a_purge_after_the_nats_server_restarted_on_the_same_port_still_drops_the_request(nats, make_stream,
                                                                                          caplog):
    caplog.set_level(logging.WARNING, "kvpool.streams")
    s = make_stream()  # file storage: the stream and its messages outlive the restart
    rx = HandoffReceiver(s, nats.url, None, timeout_s=2)
    again: NatsServer | None = None
    try:
        assert _read_live(rx, nats.url, s, "before") == []
        assert _until(lambda: _messages(nats.url, s) == 0, 3)
        port, store = nats.port, nats.store_dir
        nats.stop()
        again = NatsServer(store, port=port).start()
        assert _until(lambda: stream_info(again.url, s) is not None, 5)  # JetStream serves the stream again
        assert _read_live(rx, again.url, s, "after") == []
        rx.close()  # (waits for the purge)
        assert _messages(again.url, s) == 0, f"the request read after the restart was left in the stream: " \
                                             f"{_not_purged(caplog)}"
        assert not _not_purged(caplog)
    finally:
        rx.close()
        if again is not None:
            again.stop()


# -- close and garbage collection while a purge waits on a paused server --------------------------------


def test_close_while_a_purge_waits_on_a_frozen_nats_server_returns_within_its_bound_and_leaves_nothing(
        nats, make_stream, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "kvpool.streams")
    s = make_stream()
    with Producer(s, nats.url) as p:
        p.end_request("r", 0)
    socks = _sockets()
    rx = HandoffReceiver(s, nats.url, None, timeout_s=1)
    real = handoff.purge_upto
    asking = threading.Event()

    def frozen_first(*a: Any, **kw: Any) -> Any:
        freeze(nats.proc.pid)  # the purge's request goes to a server that answers nothing
        asking.set()
        return real(*a, **kw)
    monkeypatch.setattr(handoff, "purge_upto", frozen_first)
    try:
        assert list(rx.iter_layers("r", timeout=5)) == []  # (the end read back: its sequence known)
        assert asking.wait(5)
        time.sleep(0.1)
        t0 = time.monotonic()
        rx.close()
        took = time.monotonic() - t0
    finally:
        os.kill(nats.proc.pid, signal.SIGCONT)
    assert took <= rx._purge_s() + 0.5, f"close took {took:.2f} s (bound {rx._purge_s():.2f} s)"
    assert _purge_threads() == []
    assert _until(lambda: _sockets() <= socks, 2), f"{_sockets() - socks} socket(s) left open"
    assert _not_purged(caplog)  # the purge that got no answer is logged


def test_a_receiver_dropped_unclosed_while_a_purge_runs_lets_its_purge_thread_and_sockets_go(
        nats, make_stream, monkeypatch):
    s = make_stream()
    with Producer(s, nats.url) as p:
        p.end_request("r", 0)
    socks = _sockets()
    real = handoff.purge_upto
    started = threading.Event()

    def slow(*a: Any, **kw: Any) -> Any:
        started.set()
        time.sleep(0.5)
        return real(*a, **kw)
    monkeypatch.setattr(handoff, "purge_upto", slow)

    def use() -> weakref.ref[HandoffReceiver]:
        rx = HandoffReceiver(s, nats.url, None, timeout_s=2)
        assert list(rx.iter_layers("r", timeout=5)) == []
        assert started.wait(5)
        assert _purge_threads()
        return weakref.ref(rx)
    ref = use()  # dropped, never closed, its purge under way

    def gone() -> bool:
        gc.collect()
        return ref() is None and not _purge_threads() and _sockets() <= socks
    assert _until(gone, 5), (f"receiver alive: {ref() is not None}; threads {_purge_threads()}; "
                             f"{_sockets() - socks} socket(s)")
    assert _messages(nats.url, s) == 0  # the purge it had under way went through


# -- a stream deleted under a purge ---------------------------------------------------------------------


def test_a_stream_deleted_while_its_purge_looks_for_the_end_is_logged_not_raised(nats, make_stream,
                                                                                monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "kvpool.streams")
    s = make_stream()
    real = handoff.direct_last

    def delete_first(*a: Any, **kw: Any) -> Any:
        delete_stream(nats.url, s)
        return real(*a, **kw)
    monkeypatch.setattr(handoff, "direct_last", delete_first)
    with HandoffReceiver(s, nats.url, None, timeout_s=2) as rx:
        assert _read_live(rx, nats.url, s, "gone") == []  # returns normally
    assert any("'gone'" in m for m in _not_purged(caplog)), caplog.text


def test_a_stream_deleted_mid_purge_and_made_again_is_read_by_direct_gets_again(nats, make_stream, monkeypatch):
    """A direct get answered 503 because the stream was gone for a moment does not mean the stream serves
    no direct gets: once it is back (with allow_direct), the purges read it by direct get again, not
    through nats-py's loop (what the Wire purge exists to avoid)."""
    s = make_stream()
    real_direct, real_stored = handoff.direct_last, handoff.stored_last
    calls: list[str] = []
    deleted = threading.Event()

    def direct(*a: Any, **kw: Any) -> Any:
        if not deleted.is_set():
            deleted.set()
            delete_stream(nats.url, s)
        calls.append("direct")
        return real_direct(*a, **kw)

    def stored(*a: Any, **kw: Any) -> Any:
        calls.append("nats-py")
        return real_stored(*a, **kw)
    monkeypatch.setattr(handoff, "direct_last", direct)
    monkeypatch.setattr(handoff, "stored_last", stored)
    with HandoffReceiver(s, nats.url, None, timeout_s=2) as rx:
        assert _read_live(rx, nats.url, s, "first") == []
        assert _until(lambda: not rx._purges, 5)
        create_stream(nats.url, s, StreamConfig())  # back, serving direct gets (allow_direct)
        calls.clear()
        assert _read_live(rx, nats.url, s, "second") == []
        assert _until(lambda: not rx._purges, 5)
    assert _messages(nats.url, s) == 0
    assert "nats-py" not in calls and "direct" in calls, f"the purge's reads after the stream came back: {calls}"


# -- many requests ending at once -----------------------------------------------------------------------


def test_many_requests_ending_fast_keep_at_most_PURGING_purges_pending_and_all_are_purged(nats, make_stream,
                                                                                          monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "kvpool.streams")
    monkeypatch.setattr(handoff, "_PURGING", 3)
    s = make_stream()
    n = 12
    with Producer(s, nats.url) as p:
        for i in range(n):
            p.end_request(f"r{i}", 0)
    real = handoff.purge_upto
    pending: list[int] = []
    with HandoffReceiver(s, nats.url, None, timeout_s=2) as rx:
        def slow(*a: Any, **kw: Any) -> Any:
            with rx._purges_lock:
                pending.append(len(rx._purges))
            time.sleep(0.03)
            return real(*a, **kw)
        monkeypatch.setattr(handoff, "purge_upto", slow)
        for i in range(n):
            assert list(rx.iter_layers(f"r{i}", timeout=5)) == []
            with rx._purges_lock:
                pending.append(len(rx._purges))
    assert len(pending) >= n and max(pending) == 3, pending  # (the bound reached, never passed)
    assert _messages(nats.url, s) == 0
    assert not _not_purged(caplog)


# -- a secured server -----------------------------------------------------------------------------------


def test_the_purge_wire_authenticates_as_the_client_role_and_may_purge_on_a_secured_server(
        tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "kvpool.streams")
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "state"))
    creds = ensure_creds()
    server = NatsServer(tmp_path / "state" / "nats", port=0, authorization=authorization(creds)).start()
    try:
        s = "secured"
        create_stream(server.url, s, StreamConfig())  # (as the admin)
        with HandoffReceiver(s, server.url, None, timeout_s=2) as rx:
            assert rx._purge_wire._creds is not None and rx._purge_wire._creds.path.endswith("client.json")
            assert _read_live(rx, server.url, s, "live") == []  # the end's sequence looked up by direct get
            assert _until(lambda: not rx._purges, 5)
            errors = list(rx._purge_wire.errors)
        assert errors == []
        assert _messages(server.url, s) == 0
        assert not _not_purged(caplog)
    finally:
        server.stop()


# -- a Wire read by another thread while it makes requests ----------------------------------------------


def test_wire_requests_get_their_own_answers_while_another_thread_reads_the_same_wire(nats):
    responder = Wire(nats.url)
    rsid = responder.subscribe("svc.echo")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            m = responder.next(rsid, 0.1)
            if m is not None:
                responder.publish(m.reply, b"re:" + m.data)
    wire = Wire(nats.url)
    feed_sid = wire.subscribe("feed.x")
    publisher = Wire(nats.url)
    got: list[bytes] = []
    total = 300

    def read() -> None:
        deadline = time.monotonic() + 10
        while len(got) < total and time.monotonic() < deadline:
            m = wire.next(feed_sid, 0.5)
            if m is not None:
                got.append(m.data)

    def publish() -> None:
        for i in range(total):
            publisher.publish("feed.x", str(i).encode())
            if i % 10 == 0:
                time.sleep(0.001)
    threads = [threading.Thread(target=f, daemon=True) for f in (serve, read, publish)]
    for t in threads:
        t.start()
    try:
        answers = [wire.request("svc.echo", str(i).encode(), 5) for i in range(200)]
        threads[2].join(10)
        threads[1].join(10)
    finally:
        stop.set()
        threads[0].join(5)
        for w in (wire, responder, publisher):
            w.close()
    assert [a.data if a is not None else None for a in answers] == [b"re:" + str(i).encode() for i in range(200)]
    assert got == [str(i).encode() for i in range(total)]  # the reader lost none of its own
    assert set(wire._subs) <= {feed_sid}
