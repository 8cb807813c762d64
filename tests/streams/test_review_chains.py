"""Review of the handoff chains of one request id (commit 0e0e26f): which request a receiver takes when the
stream holds more than one of an id, by the `Kvpool-Sent` publish time, and the max_age replay check.
Real nats-server and `kvpool worker` (fixtures of tests/streams/conftest.py)."""
from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
from handoffhelp import layer_block, wait_stored

import kvpool.streams.producer as producer_mod
from kvpool.core import PoolClient
from kvpool.streams import (
    HandoffError,
    HandoffReceiver,
    HandoffTimeout,
    Producer,
    StreamConfig,
    create_stream,
)
from kvpool.streams import envelope as env
from kvpool.streams.admin import subject
from kvpool.streams.sealing import Sealer
from kvpool.streams.wire import Msg, Wire

BLOCK = 16 << 10
SENT = "Kvpool-Sent"  # (envelope.SENT)


def _block(tag: str, layer: int) -> np.ndarray:
    return layer_block(tag, layer, BLOCK)


def _publish(url: str, stream: str, pool: PoolClient, request: str, tag: str, layers: int = 2) -> None:
    """One request of `layers` layers whose blocks are `tag`'s (keys of their own)."""
    with Producer(stream, url, pool=pool) as p:
        for layer in range(layers):
            p.publish_kv(request, layer, [f"{tag}/L{layer}"], [_block(tag, layer)])
        p.end_request(request, layers)


def _clock(monkeypatch: pytest.MonkeyPatch, offset_ms: int | None) -> None:
    """The producers of this process stamp their messages with a clock `offset_ms` off the real one (a
    prefill host whose clock runs ahead or behind); None: no stamp at all (a producer of the version
    before `Kvpool-Sent`)."""
    if offset_ms is None:
        monkeypatch.setattr(producer_mod, "_sent", lambda: {})
    else:
        monkeypatch.setattr(producer_mod, "_sent",
                            lambda: {SENT: str(time.time_ns() // 1_000_000 + offset_ms)})


def _read(url: str, stream: str, pool: PoolClient, request: str,
          timeout: float = 3.0) -> list[tuple[int, list[str], bytes]] | None:
    """What a fresh receiver yields for `request`; None for a typed refusal (acceptable)."""
    with HandoffReceiver(stream, url, pool) as rx:
        try:
            return [(layer, list(keys), bytes(bufs[0])) for layer, keys, bufs in rx.iter_layers(request, timeout)]
        except (HandoffError, HandoffTimeout):
            return None



def _expect(got: list[tuple[int, list[str], bytes]] | None, tag: str, layers: int = 2) -> None:
    """`got` is request `tag`'s layers, or a typed refusal."""
    if got is None:
        return
    assert [(layer, keys) for layer, keys, _ in got] == [(layer, [f"{tag}/L{layer}"]) for layer in range(layers)]
    assert [data for _, _, data in got] == [_block(tag, layer).tobytes() for layer in range(layers)]


def test_a_request_id_used_again_is_the_new_request_when_the_earlier_prefill_hosts_clock_runs_ahead(
        nats, make_stream, pool, monkeypatch):
    """A decode engine restarted (its ids start over) asks for request 'r'. The stream holds an earlier 'r'
    nobody read, from a prefill host whose clock runs 1.9 s ahead (within the 2 s of skew kvpool allows
    elsewhere, `CLOCK_SKEW_MS`), then the new 'r' from another host, published after it. The user sees
    the earlier request's KV yielded as the new one's, checksum-verified, no error: the receiver orders
    the two chains by the hosts' clocks only. Expected: the new request's layers, or a typed refusal."""
    s = make_stream()
    _clock(monkeypatch, 1900)
    _publish(nats.url, s, pool, "r", "old")
    _clock(monkeypatch, 0)
    _publish(nats.url, s, pool, "r", "new")
    _expect(_read(nats.url, s, pool, "r"), "new")


def test_a_request_id_used_again_is_the_new_request_when_its_prefill_is_of_the_version_before(
        nats, make_stream, pool, monkeypatch):
    """A rolling upgrade: the earlier, unread request 'r' came from an upgraded prefill host (its messages
    carry `Kvpool-Sent`), the new 'r' from a host not upgraded yet (no `Kvpool-Sent`). The user sees the
    earlier request's KV yielded as the new one's, no error: an unstamped chain counts as the oldest and
    the new request is dropped as 'an earlier request of this id'. Expected: the new request's layers, or a
    typed refusal (which of the two is newer cannot be told from the times)."""
    s = make_stream()
    _clock(monkeypatch, 0)
    _publish(nats.url, s, pool, "r", "old")
    _clock(monkeypatch, None)
    _publish(nats.url, s, pool, "r", "new")
    _expect(_read(nats.url, s, pool, "r"), "new")


def _kept(url: str, stream: str, pool: PoolClient, request: str, tag: str) -> list[Msg]:
    """The messages of a request 'tag' published on `request`, as someone subscribed to the stream sees them."""
    wire = Wire(url)
    try:
        sid = wire.subscribe(subject(stream, "req", request))
        _publish(url, stream, pool, request, tag)
        kept: list[Msg] = []
        while len(kept) < 3 and (m := wire.next(sid, 2.0)) is not None:
            kept.append(m)
        return kept
    finally:
        wire.close()


def test_without_a_secret_a_complete_request_is_not_replaced_by_one_forged_after_it(nats, make_stream, pool):
    """No stream secret. The prefill published request 'r' whole; before the decode side reads it, someone
    who may publish on the stream publishes a complete request 'r' of its own (a new chain, first message
    and end, naming blocks of another request it saw on the stream). The README promises that nobody can
    inject into a request whose first message its producer published, and that two chains claiming a
    request raise HandoffError. The user sees the forged layers yielded as 'r' and no error: the real
    request is dropped as 'an earlier request of this id' since the forged chain's publish time, which
    nothing authenticates without a secret, is later. Expected: the real layers, or HandoffError."""
    s = make_stream()
    other = _kept(nats.url, s, pool, "x", "evil")  # blocks the forger can name (a request it read)
    assert len(other) == 3
    _publish(nats.url, s, pool, "r", "real")
    wire = Wire(nats.url)
    try:
        chain, subj = Sealer(), subject(s, "req", "r")
        for m in other[:2]:
            ref = env.Ref.decode(m.data)
            forged = env.Ref(ref.keys, ref.sizes, ref.checksums, "r", ref.layer, chain.next())
            wire.publish(subj, forged.encode(), {env.KIND: env.KV, SENT: str(time.time_ns() // 1_000_000)})
        end = env.End("r", 2, chain.next(last=True))
        wire.publish(subj, end.encode(), {env.KIND: env.END, env.TYPE: "json",
                                          SENT: str(time.time_ns() // 1_000_000)})
        wire.flush()
    finally:
        wire.close()
    wait_stored(nats.url, s, 9)  # x's 3, the real 3, the forged 3
    got = _read(nats.url, s, pool, "r")
    assert got is None or [keys for _, keys, _ in got] != [["evil/L0"], ["evil/L1"]], "the forged request was taken"
    _expect(got, "real")


def test_a_receiver_opened_before_its_stream_exists_drops_a_replay_older_than_the_streams_max_age(
        nats, pool, monkeypatch):
    """KVPOOL_STREAM_SECRET is set and the handoff stream keeps messages 60 s. The decode engine starts (its
    HandoffReceiver made) before the stream is created; then a request 'r' signed an hour ago is published
    on it again (a replay). A receiver made after the stream drops it as older than max_age (the README's
    rule); this one yields the hour-old request as 'r', with no error, for its first 30 s: the max_age
    asked for when it was made failed (no stream yet), and is asked again only after `RETENTION_S`.
    Expected: the replay dropped (HandoffTimeout, no new request is published)."""
    monkeypatch.setenv("KVPOOL_STREAM_SECRET", "review-chains-secret")
    name = "early_stream"
    with HandoffReceiver(name, nats.url, pool) as rx:
        asking = getattr(rx._retention, "_asking", None)  # the receiver's first ask (no stream yet) has answered
        if asking is not None:
            concurrent.futures.wait([asking], 5)
        create_stream(nats.url, name, StreamConfig(max_age_s=60))
        _clock(monkeypatch, -3_600_000)  # the replayed messages: signed an hour ago
        _publish(nats.url, name, pool, "r", "old")
        with pytest.raises(HandoffTimeout):
            got = [(layer, bytes(bufs[0])) for layer, _, bufs in rx.iter_layers("r", timeout=1.0)]
            pytest.fail(f"the hour-old replay was yielded: layers {[layer for layer, _ in got]}")
        assert rx.counts["rejected"] >= 3




def test_a_request_id_used_again_is_the_new_request_when_many_earlier_ones_arewait_stored(nats, make_stream, pool):
    """A decode engine crash-loops: each start asks for request 'r' again (its ids start over) and dies
    before reading it, so the stream holds 64 earlier, complete requests 'r' of 63 layers (4096 messages),
    then the one the engine now asks for. The user sees the 64th earlier request's KV yielded as 'r', no
    error: the receiver picks the newest chain among those of its first read-back, which stops at 4096
    messages (`live._RECOVER_BATCH`) before the new request's. Expected: the new request's layers, or a
    typed refusal."""
    s = make_stream()
    tiny = np.zeros(16, np.uint8)
    with Producer(s, nats.url, pool=pool, hold_s=0) as p:  # (a message a layer: 4096 of them, as it says)
        for i in range(64):
            for layer in range(63):
                p.publish_kv("r", layer, [f"old{i}/x"], [tiny])
            p.end_request("r", 63)
    _publish(nats.url, s, pool, "r", "new")
    _expect(_read(nats.url, s, pool, "r", timeout=5), "new")
