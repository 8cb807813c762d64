"""Stream semantics on a real nats-server: order, acks, replay, fan-out vs groups, limits, payload checks."""
from __future__ import annotations

import datetime
import time

import pytest

from kvpool.core.client import PoolClient
from kvpool.core.errors import ConfigError
from kvpool.streams import (
    Consumer,
    PayloadError,
    Producer,
    StreamFull,
    StreamNotFound,
    create_stream,
    delete_stream,
    list_streams,
    stream_info,
)


def _drain(c: Consumer, timeout: float = 0.3) -> list[int]:
    seqs = []
    while (m := c.receive(timeout)) is not None:
        seqs.append(int(m.json()["i"]))
        m.ack()
    return seqs


def test_messages_arrive_in_publish_order_with_their_sequences(nats, make_stream):
    s = make_stream()
    with Producer(s, nats.url) as p, Consumer(s, nats.url) as c:
        seqs = [p.publish({"i": i}) for i in range(50)]
        assert seqs == list(range(1, 51))
        got = []
        for _ in range(50):
            m = c.receive(2)
            got.append((m.seq, m.json()["i"], m.kind, m.is_json))
            m.ack()
        assert got == [(i + 1, i, "inline", True) for i in range(50)]
        assert c.receive(0.2) is None


def test_unacked_message_is_redelivered_after_ack_wait_and_acked_one_is_not(nats, make_stream):
    s = make_stream()
    with Producer(s, nats.url) as p, Consumer(s, nats.url, ack_wait_s=1.0) as c:
        p.publish(b"first")
        p.publish(b"second")
        m1 = c.receive(2)
        m2 = c.receive(2)
        assert (bytes(m1.data), m1.delivered, bytes(m2.data)) == (b"first", 1, b"second")
        m2.ack()
        again = c.receive(3)  # m1 was never acked
        assert (again.seq, again.delivered, bytes(again.data)) == (m1.seq, 2, b"first")
        again.ack()
        assert c.receive(1.5) is None


def test_replay_from_a_sequence_and_from_a_time(nats, make_stream):
    s = make_stream()
    with Producer(s, nats.url) as p:
        for i in range(5):
            p.publish({"i": i})
        time.sleep(0.05)
        middle = datetime.datetime.now(datetime.timezone.utc)
        time.sleep(0.05)
        for i in range(5, 8):
            p.publish({"i": i})
    with Consumer(s, nats.url, start=4) as c:
        assert _drain(c) == [3, 4, 5, 6, 7]
    with Consumer(s, nats.url, start=middle) as c:
        assert _drain(c) == [5, 6, 7]
    with Consumer(s, nats.url, start="last") as c:
        assert _drain(c) == [7]


def test_fan_out_gives_every_consumer_every_message_and_a_group_splits_them(nats, make_stream):
    s = make_stream()
    with Consumer(s, nats.url) as a, Consumer(s, nats.url) as b, \
            Consumer(s, nats.url, group="g") as g1, Consumer(s, nats.url, group="g") as g2:
        with Producer(s, nats.url) as p:
            for i in range(20):
                p.publish({"i": i})
        assert _drain(a) == list(range(20))
        assert _drain(b) == list(range(20))
        first, second = [], []
        for _ in range(10):  # alternate members: each takes whatever is next
            for c, got in ((g1, first), (g2, second)):
                m = c.receive(1)
                if m is not None:
                    got.append(m.json()["i"])
                    m.ack()
        assert sorted(first + second) == list(range(20))
        assert first and second and not set(first) & set(second)


def test_pending_unacked_messages_are_bounded_per_consumer(nats, make_stream):
    s = make_stream()
    with Producer(s, nats.url) as p, Consumer(s, nats.url, max_ack_pending=3) as c:
        for i in range(10):
            p.publish({"i": i})
        held = [c.receive(1) for _ in range(3)]
        assert [m.json()["i"] for m in held] == [0, 1, 2]
        assert c.receive(0.5) is None  # a 4th would exceed max_ack_pending
        held[0].ack()
        assert c.receive(1).json()["i"] == 3


def test_full_stream_with_discard_new_raises_stream_full_until_consumers_ack(nats, make_stream):
    s = make_stream(max_msgs=4, discard="new", retention="interest")
    with Consumer(s, nats.url) as c, Producer(s, nats.url) as p:
        for i in range(4):
            p.publish({"i": i})
        with pytest.raises(StreamFull, match="max_msgs"):
            p.publish({"i": 4})
        m = c.receive(1)
        m.ack()
        deadline = time.monotonic() + 3
        while True:  # the ack frees one slot (interest retention) shortly after
            try:
                assert p.publish({"i": 4}) == 5
                break
            except StreamFull:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert _drain(c) == [1, 2, 3, 4]


def test_retention_by_count_and_bytes_drops_oldest(nats, make_stream):
    s = make_stream(max_msgs=3)
    with Producer(s, nats.url) as p:
        for i in range(6):
            p.publish({"i": i})
    info = stream_info(nats.url, s)
    assert (info["messages"], info["first_seq"], info["last_seq"]) == (3, 4, 6)
    with Consumer(s, nats.url) as c:
        assert _drain(c) == [3, 4, 5]
    b = make_stream(max_bytes=4096, discard="new")
    with Producer(b, nats.url) as p, pytest.raises(StreamFull, match="max_bytes"):
        for _ in range(100):
            p.publish(b"x" * 1000)


def test_retention_by_age_drops_old_messages(nats, make_stream):
    s = make_stream(max_age_s=1.0)
    with Producer(s, nats.url) as p:
        p.publish({"i": 0})
    deadline = time.monotonic() + 5
    while stream_info(nats.url, s)["messages"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_large_payload_goes_by_reference_and_comes_back_identical(nats, make_stream):
    s = make_stream()
    data = bytes(range(256)) * 4096 * 5 + b"tail"  # 5 MiB + 4: two pool blocks
    with PoolClient(dram_bytes="64MiB") as pool, Producer(s, nats.url, pool=pool, inline_max=1024) as p, \
            Consumer(s, nats.url, pool=pool) as c:
        p.publish(data)
        p.publish(b"small")
        assert stream_info(nats.url, s)["bytes"] < 2048
        m = c.receive(2)
        assert (m.kind, m.size, len(m.blocks)) == ("ref", len(data), 2)
        assert bytes(m.data) == data
        m.ack()
        into = bytearray(len(data) + 10)
        p.publish(data)
        small = c.receive(2)
        assert (small.kind, bytes(small.data)) == ("inline", b"small")
        m = c.receive(2, into=into)
        assert m.data.obj is into and bytes(into[:len(data)]) == data


def test_missing_or_corrupt_block_is_an_error_for_that_message_not_wrong_bytes(nats, make_stream):
    s = make_stream()
    with PoolClient(dram_bytes="64MiB") as pool, Producer(s, nats.url, pool=pool, inline_max=0) as p, \
            Consumer(s, nats.url, pool=pool) as c, Consumer(s, nats.url) as no_pool:
        p.publish(b"a" * 1000)
        p.publish(b"b" * 1000)
        p.publish(b"c" * 1000)
        with pytest.raises(PayloadError, match="needs a pool"):
            no_pool.receive(2)
        refs = _refs(s, nats.url, pool, 3)
        pool.batch_remove(refs[0].keys)
        pool.put(refs[1].keys[0], b"B" * 1000)  # same size, other bytes
        with pytest.raises(PayloadError, match="missing") as missing:
            c.receive(2)
        missing.value.message.term()
        with pytest.raises(PayloadError, match="checksum") as corrupt:
            c.receive(2)
        corrupt.value.message.term()
        m = c.receive(2)
        assert bytes(m.data) == b"c" * 1000


def _refs(stream: str, url: str, pool: PoolClient, n: int) -> list:
    """The references of the first `n` messages, read by a private consumer (fetching them intact)."""
    with Consumer(stream, url, pool=pool) as peek:
        return [peek.receive(2).ref for _ in range(n)]


def test_admin_create_list_info_delete(nats):
    info = create_stream(nats.url, "adm")
    assert info["name"] == "adm" and info["messages"] == 0
    assert [i["name"] for i in list_streams(nats.url)] == ["adm"]
    delete_stream(nats.url, "adm")
    with pytest.raises(StreamNotFound):
        stream_info(nats.url, "adm")
    with pytest.raises(StreamNotFound), Producer("adm", nats.url) as p:
        p.publish(b"x")


def test_bad_names_and_options_are_config_errors(nats, make_stream):
    s = make_stream()
    with pytest.raises(ConfigError, match="stream name"):
        Producer("a.b", nats.url)
    with pytest.raises(ConfigError, match="start"):
        Consumer(s, nats.url, start="yesterday")
    with pytest.raises(ConfigError, match="timezone"):
        Consumer(s, nats.url, start=datetime.datetime.now())
    with Producer(s, nats.url, inline_max=4) as p:
        with pytest.raises(ConfigError, match="needs a PoolClient"):
            p.publish(b"too large")
        with pytest.raises(ConfigError, match="request id"):
            p.end_request("a b")
