"""Review of c8a1e54 (a request's end carries one JetStream duplicate id, `kvpool-end.<chain nonce>`; the
stream's max_age is read under a lock, and a wait for it that went unanswered is not made again),
4b5ff02 (a closed HostIO stays closed) and ffa427a (read repair in a module of its own). Real nats-server
and `kvpool worker`; each test fails on a real bug."""
from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvpool.streams.producer as producer_mod
from kvpool.core.client import PoolClient
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.streams import HandoffReceiver, HandoffTimeout, Producer, StreamConfig, create_stream, live, stream_info
from kvpool.streams.admin import subject
from kvpool.streams.handoff import RETENTION_WAIT_S
from kvpool.streams.wire import Wire

BLOCK = 16 << 10
SECRET = "review-thirteenth-secret"
SENT = "Kvpool-Sent"  # (envelope.SENT)


@pytest.fixture
def pool(nats: NatsServer, spawn) -> Iterator[PoolClient]:  # type: ignore[no-untyped-def]
    """A cluster client of one `kvpool worker` in the test's NATS cluster."""
    w: WorkerProcess = spawn(nats_url=nats.url)
    assert w is not None
    with PoolClient(mode="cluster", nats_url=nats.url) as c:
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        yield c


def _block(tag: str, layer: int) -> np.ndarray:
    return np.random.default_rng([sum(tag.encode()), layer]).integers(0, 256, BLOCK, dtype=np.uint8)


def _stored(url: str, stream: str, messages: int) -> None:
    """Wait (5 s at most) until `stream` holds `messages` messages."""
    deadline = time.monotonic() + 5
    while stream_info(url, stream)["messages"] != messages and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream_info(url, stream)["messages"] == messages


def test_an_end_whose_duplicate_id_a_stranger_used_first_is_not_reported_stored(nats, pool, monkeypatch):
    """KVPOOL_STREAM_SECRET is set: a NATS user without it may publish to the stream, but the README says
    its messages are dropped and it cannot take part in a request. Such a user reads the first message of
    request 'r' (as any subscriber can) and takes the chain nonce from its body; it publishes one junk
    message on another subject of the stream under the header `Nats-Msg-Id: kvpool-end.<nonce>`: the
    duplicate id the producer's `end_request('r')` will use. The producer then sees `end_request` return a
    sequence (JetStream answered "duplicate", with the junk's sequence) though its end was never stored,
    and the decode side waits for an end that never comes (HandoffTimeout). Expected: the end stored (or
    end_request raising a typed error): a duplicate id nobody but the producer can know (a random one of
    the chain's own, never in a message), or a duplicate answer checked against what is stored."""
    monkeypatch.setenv("KVPOOL_STREAM_SECRET", SECRET)
    s = "claimed_end"
    create_stream(nats.url, s, StreamConfig())
    spy = Wire(nats.url, 5.0)
    try:
        sid = spy.subscribe(subject(s, "req", "r"))
        with Producer(s, nats.url, pool=pool) as p:
            p.publish_kv("r", 0, ["r/L0"], [_block("r", 0)])
            p.flush()
            first = spy.next(sid, 5)
            assert first is not None, "the request's first message never came live"
            nonce = json.loads(bytes(first.data))["seal"]["nonce"]
            spy.publish(subject(s, "junk"), b"junk", {"Nats-Msg-Id": f"kvpool-end.{nonce}"})  # unsigned
            _stored(nats.url, s, 2)
            seq = p.end_request("r", 1)  # (a typed error here would be an acceptable answer)
    finally:
        spy.close()
    with HandoffReceiver(s, nats.url, pool) as rx:
        try:
            got = [(layer, bytes(bufs[0])) for layer, _, bufs in rx.iter_layers("r", timeout=1.5)]
        except HandoffTimeout as e:
            pytest.fail(f"end_request returned sequence {seq}, but no end was stored (a stranger's message took "
                        f"its duplicate id): {e}")
    assert got == [(0, _block("r", 0).tobytes())]


def test_a_receiver_whose_first_max_age_wait_found_no_stream_drops_a_replay_once_the_stream_exists(
        nats, pool, monkeypatch):
    """KVPOOL_STREAM_SECRET is set; the decode engine's HandoffReceiver is made before the handoff stream
    (the case 59bcc34 fixed). A message on the request's subject is checked while the stream does not
    exist yet (one that came live before the stream was made; stood in for here by the check the receiver
    makes for it, `max_age_s(RETENTION_WAIT_S)`): its wait for the stream's max_age is answered at once,
    "no such stream". The stream is then made (max_age 60 s) and, a second later, request 'r' signed an
    hour ago is published again (a replay). The user sees the hour-old layer yielded as 'r': that quick
    "not found" counted as a wait that went unanswered (`Retention._waited_in_vain`), so the receiver
    never waits for the max_age again, and checks the replay without it, though the stream answers within
    a millisecond. The README and `RETENTION_WAIT_S` say a message waits up to 1 s for the answer (and
    "passes unchecked where none comes"). Expected: the replay dropped, nothing yielded (HandoffTimeout)."""
    monkeypatch.setenv("KVPOOL_STREAM_SECRET", SECRET)
    name = "late_stream"
    with HandoffReceiver(name, nats.url, pool) as rx:
        asking = rx._retention._asking  # the ask made with the receiver (no stream yet)
        if asking is not None:
            concurrent.futures.wait([asking], 5)
        assert rx._retention.max_age_s(min(RETENTION_WAIT_S, 5.0)) is None  # a message checked: no stream yet
        create_stream(nats.url, name, StreamConfig(max_age_s=60))
        time.sleep(live.ASK_AGAIN_S + 0.5)
        monkeypatch.setattr(producer_mod, "_sent", lambda: {SENT: str(time.time_ns() // 1_000_000 - 3_600_000)})
        with Producer(name, nats.url, pool=pool) as p:  # the replay: signed an hour ago
            p.publish_kv("r", 0, ["old/L0"], [_block("old", 0)])
            p.end_request("r", 1)
        got: list[int] = []
        try:
            for layer, _, _ in rx.iter_layers("r", timeout=1.0):
                got.append(layer)
        except HandoffTimeout:
            pass
        assert got == [], f"the hour-old replay was yielded (layers {got}); the stream's max_age was not waited for"
