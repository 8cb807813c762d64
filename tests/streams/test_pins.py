"""Pinned until acked: a by-reference payload's blocks survive eviction pressure while its message may
still be read, and become evictable once every consumer acked it, retention dropped it, or its
producer died and the pin's TTL ran out."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from kvpool.core.client import PoolClient
from kvpool.streams import Consumer, HandoffReceiver, PayloadError, Producer, StreamFull
from kvpool.streams.pins import PinKeeper, _StreamState, subject_matches

MiB = 1 << 20
PAYLOAD = bytes(range(256)) * (32 * 1024)  # 8 MiB: two 4 MiB blocks


@pytest.fixture
def pool(nats, spawn):
    """A pool of one 32 MiB worker without SSD: an evicted block is gone."""
    spawn(nats_url=nats.url, dram_bytes="32MiB")
    with PoolClient(mode="cluster", nats_url=nats.url) as c:
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        yield c


def squeeze(pool: PoolClient, rounds: int = 12) -> None:
    """Put more 4 MiB blocks than the arena holds: every unpinned older block gets evicted."""
    for i in range(rounds):
        pool.put(f"filler/{i}", bytes([i]) * (4 * MiB))


def payload_keys(pool: PoolClient, stream: str, nats_url: str) -> list:
    with Consumer(stream, nats_url, pool=pool, fetch=False) as c:
        return c.receive(5).ref.keys


def record_unpins(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys of each unpin request (`PoolClient.batch_pin` of 0 seconds) from now on, in order; the
    requests still go to the pool."""
    unpins: list[list[str]] = []
    real = PoolClient.batch_pin

    def batch_pin(self: PoolClient, keys, seconds: float) -> None:
        if seconds <= 0:
            unpins.append(list(keys))
        real(self, keys, seconds)

    monkeypatch.setattr(PoolClient, "batch_pin", batch_pin)
    return unpins


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_unpinned_payload_is_lost_to_eviction_pressure(nats, make_stream, pool):
    s = make_stream()
    with Producer(s, nats.url, pool=pool, pin_ttl_s=0) as p:
        p.publish(PAYLOAD)
    squeeze(pool)
    with Consumer(s, nats.url, pool=pool) as c, pytest.raises(PayloadError, match="missing"):
        c.receive(5)


def test_payload_survives_pressure_until_the_group_acks_then_is_evictable(nats, make_stream, pool):
    s = make_stream()
    with Producer(s, nats.url, pool=pool, pin_ttl_s=8) as p, Consumer(s, nats.url, pool=pool, group="decode") as c:
        p.publish(PAYLOAD)
        keys = payload_keys(pool, s, nats.url)
        squeeze(pool)
        msg = c.receive(5)
        assert bytes(msg.data) == PAYLOAD
        squeeze(pool)  # delivered but not acked: still pinned
        assert pool.batch_exists(keys) == [True, True]
        msg.ack()
        assert wait_until(lambda: (squeeze(pool), pool.batch_exists(keys))[1] == [False, False], timeout=5)


def test_retention_dropping_the_message_releases_its_blocks(nats, make_stream, pool):
    s = make_stream(max_msgs=1)
    with Producer(s, nats.url, pool=pool, pin_ttl_s=8) as p:
        p.publish(PAYLOAD)
        old = payload_keys(pool, s, nats.url)
        p.publish(PAYLOAD[::-1])  # max_msgs=1: the first message is dropped
        new = payload_keys(pool, s, nats.url)
        assert wait_until(lambda: (squeeze(pool), pool.batch_exists(old))[1] == [False, False], timeout=5)
        assert pool.batch_exists(new) == [True, True]


def test_handoff_layers_stay_pinned_until_the_decode_side_has_read_the_request(nats, make_stream, pool):
    s = make_stream()
    keys = [f"req/L{i}" for i in range(2)]
    with Producer(s, nats.url, pool=pool, pin_ttl_s=8) as p, HandoffReceiver(s, nats.url, pool) as rx:
        for i, key in enumerate(keys):
            p.publish_kv("req", i, [key], [bytes([i]) * (4 * MiB)])
        p.end_request("req", 2)
        squeeze(pool)
        got = [(layer, bytes(bufs[0])) for layer, _, bufs in rx.iter_layers("req", timeout=5)]
        assert got == [(i, bytes([i]) * (4 * MiB)) for i in range(2)]
        assert wait_until(lambda: (squeeze(pool), pool.batch_exists(keys))[1] == [False, False], timeout=5)


def test_a_refused_kv_announcement_is_stream_full_and_its_blocks_are_unpinned(nats, make_stream, pool):
    s = make_stream(max_msgs=2, discard="new")
    keys = [f"r/L{i}" for i in range(3)]
    with Producer(s, nats.url, pool=pool, pin_ttl_s=30, hold_s=0) as p:  # (a message a layer)
        for i, key in enumerate(keys):
            p.publish_kv("r", i, [key], [bytes([i]) * (4 * MiB)])  # the third does not fit in the stream
        with pytest.raises(StreamFull):
            p.end_request("r")
        squeeze(pool)
        assert pool.batch_exists(keys) == [True, True, False]  # stored and unread: pinned; refused: evicted


def test_pins_of_a_killed_producer_expire_after_their_ttl(nats, make_stream, pool):
    s = make_stream()
    code = textwrap.dedent(f"""
        import time
        from kvpool.core.client import PoolClient
        from kvpool.streams import Producer
        pool = PoolClient(mode="cluster", nats_url={nats.url!r})
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        p = Producer({s!r}, {nats.url!r}, pool=pool, pin_ttl_s=3)
        p.publish(bytes(8 << 20))
        print("published", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "published"
        child.kill()
        child.wait()
    finally:
        child.kill()
        child.stdout.close()
    keys = payload_keys(pool, s, nats.url)
    t = time.monotonic()
    squeeze(pool)
    assert pool.batch_exists(keys) == [True, True]  # nobody acked: pinned until the TTL ends
    assert wait_until(lambda: (squeeze(pool), pool.batch_exists(keys))[1] == [False, False], timeout=8)
    assert time.monotonic() - t < 8


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_put_with_pin_over_each_transport_then_unpin(spawn, transport):
    w = spawn(dram_bytes="32MiB")
    with PoolClient(mode="local", worker=w.address if transport == "tcp" else w.unix_path) as c:
        c.batch_put(["kept"], [bytes(4 * MiB)], pin_s=30)
        squeeze(c)
        assert c.batch_exists(["kept"]) == [True]
        c.batch_pin(["kept"], 0)
        squeeze(c)
        assert c.batch_exists(["kept"]) == [False]


@pytest.mark.parametrize("filt,subj,ok", [
    ("a.b", "a.b", True), ("a.*", "a.b", True), ("a.>", "a.b.c", True), ("a.>", "a", False),
    ("a.*", "a.b.c", False), ("a.b", "a.c", False), ("a.b.c", "a.b", False),
])
def test_subject_matches(filt, subj, ok):
    assert subject_matches(filt, subj) is ok


def test_stream_state_decides_done_conservatively():
    def consumer(filt: str, floor: int, ack: str = "explicit") -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(filter_subject=filt, filter_subjects=None, ack_policy=ack),
                               ack_floor=SimpleNamespace(stream_seq=floor))

    info = {"total": 1, "state": {"first_seq": 5, "subjects": {"k.s.msg": 3}}}
    state = _StreamState(info, [consumer("k.s.msg", 6), consumer("k.s.req.*", 0, ack="none")])
    assert state.done(4, "k.s.msg")  # retention dropped it
    assert state.done(9, "k.s.req.r1")  # its subject holds nothing any more: purged
    assert state.done(6, "k.s.msg") and not state.done(7, "k.s.msg")  # acked up to 6 by every group
    assert not _StreamState(info, []).done(6, "k.s.msg")  # no consumer yet: wait for one
    paged = _StreamState({"total": 2, "state": {"first_seq": 5, "subjects": {"k.s.msg": 3}}}, [])
    assert not paged.done(9, "k.s.req.r1")  # a partial subject list proves nothing


def test_a_publish_that_timed_out_keeps_its_payload_for_a_stored_message(nats, pool, monkeypatch):
    """A timeout leaves the outcome unknown (JetStream may have stored the message, as during a NATS
    restart): the payload's blocks must stay, so a consumer of the stored message finds them."""
    from kvpool.streams import StreamTimeout, create_stream
    create_stream(nats.url, "maybe")
    real_send = Producer._send

    def stored_then_timed_out(self, subj, body, headers):
        real_send(self, subj, body, headers)
        raise StreamTimeout("publish: timed out")

    with Producer("maybe", nats.url, pool) as p:
        monkeypatch.setattr(Producer, "_send", stored_then_timed_out)
        with pytest.raises(StreamTimeout):
            p.publish(PAYLOAD)
        monkeypatch.setattr(Producer, "_send", real_send)
    with Consumer("maybe", nats.url, pool=pool) as c:
        msg = c.receive(5)
        assert bytes(msg.data) == PAYLOAD
        msg.ack()


def test_unacked_payloads_past_the_budget_are_unpinned_oldest_first(nats, pool):
    """A consumer that never acks used to keep every payload pinned until the pool refused all puts."""
    from kvpool.streams import create_stream
    create_stream(nats.url, "hoard")
    with Producer("hoard", nats.url, pool, max_pinned_bytes=16 * MiB) as p:
        for i in range(4):  # 4 x 8 MiB in a 32 MiB pool: pinned whole, nothing else would fit
            p.publish(bytes([i]) * (8 * MiB))
        with Consumer("hoard", nats.url, pool=pool, group="never-acks", fetch=False):
            squeeze(pool)  # unrelated puts succeed: the two oldest payloads were unpinned and evicted
        with Consumer("hoard", nats.url, pool=pool) as c:
            got = []
            for _ in range(4):
                try:
                    got.append(bytes(c.receive(5).data)[:1])
                except PayloadError as e:
                    got.append(None)
                    e.message.term()
        assert got[2:] == [b"\x02", b"\x03"] and got[:2] == [None, None]


def test_handoffs_nobody_reads_are_within_the_budget_too(nats, pool):
    """A handoff's layers stay pinned while its request's messages are in the stream, and nothing purges
    a request no decode side reads: they count against max_pinned_bytes as published payloads do."""
    from kvpool.streams import create_stream
    create_stream(nats.url, "unread")
    with Producer("unread", nats.url, pool, max_pinned_bytes=8 * MiB) as p:
        for r in range(12):  # 12 x 4 MiB layers in a 32 MiB pool, none ever read
            p.publish_kv(f"r{r}", 0, [f"unread/r{r}/L0"], [bytes([r]) * (4 * MiB)])
            p.end_request(f"r{r}", 1)
        p.flush()
        squeeze(pool)  # unrelated puts succeed: the oldest layers were unpinned and evicted


def test_past_the_budget_pins_are_dropped_in_batches_oldest_first(nats, make_stream, pool, monkeypatch):
    """A producer ahead of its reconciler is over the budget at almost every layer: each time over, the
    oldest layers are unpinned down to 3/4 of the budget in one request, not one request per layer."""
    unpins = record_unpins(monkeypatch)
    s = make_stream()
    layers = 16
    with Producer(s, nats.url, pool, max_pinned_bytes=4 * MiB) as p:
        for layer in range(layers):  # 1 MiB each, nothing ever read
            p.publish_kv("r", layer, [f"r/L{layer}"], [bytes([layer]) * MiB])
            p.flush()  # its announcement stored: counted against the budget
        unpinned = [k for keys in unpins for k in keys]
        assert sorted(unpinned) == sorted(f"r/L{i}" for i in range(len(unpinned)))  # the oldest, each once
        assert layers - len(unpinned) <= 4  # within the budget (4 MiB)
        assert len(unpins) <= (layers - 4) // 2  # in batches: one request per two layers over it at most


def test_layers_read_are_released_by_an_early_pass_not_dropped_by_the_budget(nats, make_stream, pool, monkeypatch,
                                                                            caplog):
    """A producer that puts more than its budget within one period of its reconciler (a pass a second here),
    its layers read as they come: once its pins take half the budget the reconciler makes a pass at once,
    which releases what was read. The budget drops nothing, and no read layer is logged as unread."""
    unpins = record_unpins(monkeypatch)
    s = make_stream()
    with caplog.at_level(logging.WARNING, logger="kvpool.streams.pins"), \
            Producer(s, nats.url, pool, pin_ttl_s=60, max_pinned_bytes=8 * MiB) as p, \
            HandoffReceiver(s, nats.url, pool) as rx:
        for r in range(12):  # 12 MiB through an 8 MiB budget, within a second
            p.publish_kv(f"r{r}", 0, [f"r{r}/L0"], [bytes([r]) * MiB])
            p.end_request(f"r{r}", 1)
            assert [bytes(bufs[0]) for _, _, bufs in rx.iter_layers(f"r{r}", timeout=5)] == [bytes([r]) * MiB]
        read_early = {f"r{r}/L0" for r in range(6)}
        assert wait_until(lambda: read_early <= {k for keys in unpins for k in keys}, timeout=0.5)  # (the period: 1 s)
        assert not [m for m in caplog.messages if "max_pinned_bytes" in m]


def test_with_nothing_read_the_early_passes_stop(nats, make_stream, pool, monkeypatch):
    """Past half its budget with nothing read, the reconciler makes a pass at once, and the passes that
    release nothing come ever further apart (20 ms after the first, doubling): a few passes, not one every
    few milliseconds for as long as nothing is read."""
    passes = []
    reconcile = PinKeeper.reconcile
    monkeypatch.setattr(PinKeeper, "reconcile", lambda keeper: (passes.append(1), reconcile(keeper))[1])
    s = make_stream()
    block = bytes(16 << 10)
    with Producer(s, nats.url, pool, pin_ttl_s=60, max_pinned_bytes=MiB, hold_s=0) as p:  # a message a layer
        started = time.monotonic()
        for layer in range(800):  # 12.5 MiB through a 1 MiB budget, none of it read
            p.publish_kv("r", layer, [f"r/L{layer}"], [block])
        p.flush()
        periodic = int(time.monotonic() - started)  # (a pass a second besides: the period's)
        assert 1 <= len(passes) <= 6 + periodic  # at 0, 20, 60, 140, 300 ms from the first at most (not 30)
