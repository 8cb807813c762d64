"""Forged stream messages (issue 11): whatever anyone publishes straight to a stream's NATS subjects
arrives as a message the consumer can ack or terminate (kind 'invalid', with a typed `error`), is
checked against limits before anything is allocated, and never stops a consumer or group; an unsettled
one goes to the dead-letter subject after `max_deliver` deliveries. Against a real nats-server and a
`kvpool worker`; the forger is a plain nats-py client on the stream's subjects."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from streamhelp import forge

from kvpool.core import InvalidArgument, nats_connect
from kvpool.streams import (
    AsyncConsumer,
    Consumer,
    ForgedMessage,
    Limits,
    MalformedMessage,
    Producer,
    dead_subject,
)
from kvpool.streams.cli import add_parser
from kvpool.streams.envelope import End, Ref, kind_of

GiB = 1 << 30


def _ref(keys: list[Any], sizes: list[Any], sums: list[Any] | None = None, **more: Any) -> bytes:
    return json.dumps({"keys": keys, "sizes": sizes, "checksums": sums or [0] * len(sizes), **more}).encode()


def bad_messages(stream: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """The report's forgeries and their cousins: each must arrive as one 'invalid' message."""
    s = f"kvpool.stream.{stream}.msg"
    ref = {"Kvpool-Kind": "ref"}
    return [
        (s, b"x", {"Kvpool-Kind": "bogus"}),                                   # unknown kind
        (s, b"{not json", ref),                                                # malformed reference
        (s, _ref([""], [4]), ref),                                             # empty key
        (s, _ref(["k" * 600], [4]), ref),                                      # 600-byte key
        (s, _ref(["k"], [-1]), ref),                                           # negative size
        (s, b"\xff\xfe\x00garbage", ref),                                      # undecodable body
        (s, b'{"keys": ["\\ud800"], "sizes": [4], "checksums": [0]}', ref),   # lone surrogate in a key
        (s, b'{"keys": [{"hex": "zz"}], "sizes": [4], "checksums": [0]}', ref),
        (s, b"[" * 100_000, ref),                                              # nesting deep enough to recurse
        (s, _ref(["k"], [64 * GiB]), ref),                                     # 64 GiB block
        (s, _ref([f"k{i}" for i in range(300)], [4 << 20] * 300), ref),       # 1.2 GiB in total
        (s, _ref([f"{i}" for i in range(70_000)], [1] * 70_000), ref),        # too many keys
        (s, _ref(["k"], [4], [-5]), ref),                                      # checksum not a u64
        (s, _ref(["k"], [True]), ref),                                         # a bool is no size
        (s, b'{"request": "\\udfff", "layers": 2}', {"Kvpool-Kind": "end"}),  # surrogate in a request id
        (f"kvpool.stream.{stream}.req.r1", _ref(["k"], [4], request="r1", layer=-3), {"Kvpool-Kind": "kv"}),
    ]


def test_every_forged_message_is_an_invalid_message_to_term_and_good_ones_still_flow(nats, stream, pool):
    """3 forgeries with max_ack_pending=3 once kept a group from its good messages (at the default
    1000, for good); now each arrives as an 'invalid' message with a typed error, termed, and the
    group gets all its good messages. Nothing is allocated for the 64 GiB or 1.2 GiB references."""
    bad = bad_messages(stream)
    forge(nats.url, bad[:3])
    with Producer(stream, nats.url, pool=pool, inline_max=1024) as p:
        for i in range(5):
            p.publish({"i": i})
        p.publish(b"r" * 5000)  # by reference, through the worker
    forge(nats.url, bad[3:])
    good, invalid = [], []
    with Consumer(stream, nats.url, pool=pool, group="g", max_ack_pending=3, ack_wait_s=30) as c:
        deadline = time.monotonic() + 20
        while len(good) + len(invalid) < 6 + len(bad):
            assert time.monotonic() < deadline, (good, [m.error for m in invalid])
            m = c.receive(1)
            if m is None:
                continue
            if m.error is not None:
                assert (m.kind, m.data, m.ref) == ("invalid", b"", None)
                with pytest.raises(MalformedMessage):
                    m.json()
                invalid.append(m)
                m.term()
            else:
                good.append(m.json()["i"] if m.kind == "inline" else bytes(m.data))
                m.ack()
        assert c.receive(0.5) is None
        assert c.counts == {"invalid": len(bad), "forged": 0, "dead": 0}
    assert good == [0, 1, 2, 3, 4, b"r" * 5000]
    assert all(isinstance(m.error, MalformedMessage) and m.delivered == 1 for m in invalid)
    errors = {m.seq: m.error for m in invalid}
    sizes = {(e.size, e.limit) for e in errors.values()}
    assert (64 * GiB, pool.max_block) in sizes          # checked against the worker's max block
    assert (300 * (4 << 20), Limits().max_bytes) in sizes
    assert (70_000, Limits().max_keys) in sizes
    assert any("unknown message kind" in str(e) for e in errors.values())
    assert any("UTF-8" in str(e) for e in errors.values())


def test_limits_are_the_consumers_choice(nats, stream, pool):
    with Producer(stream, nats.url, pool=pool, inline_max=0) as p:
        p.publish(b"z" * 10_000)
    with Consumer(stream, nats.url, pool=pool, limits=Limits(max_bytes=4096)) as c:
        m = c.receive(2)
        assert m.kind == "invalid" and (m.error.size, m.error.limit) == (10_000, 4096)
        m.term()
    with Consumer(stream, nats.url, pool=pool) as c:
        assert bytes(c.receive(2).data) == b"z" * 10_000


def test_unsettled_messages_go_to_the_dead_letter_subject_after_max_deliver(nats, stream):
    """A consumer that ignores what it cannot read (never acks or terms it) is no longer stuck behind
    it: after max_deliver deliveries the consumer itself publishes it to kvpool.dead.<stream> and
    terminates it."""
    dead: list[Any] = []

    async def watch(ready: asyncio.Event, done: asyncio.Event) -> None:
        nc = await nats_connect(nats.url, 5, logging.getLogger("test.forger"))
        sub = await nc.subscribe(dead_subject(stream))
        await nc.flush()
        ready.set()
        while len(dead) < 3:
            try:
                dead.append(await sub.next_msg(0.2))
            except asyncio.TimeoutError:
                if done.is_set():
                    break
        await nc.close()

    async def scenario() -> tuple[list[int], dict[str, int], dict[int, int]]:
        ready, done = asyncio.Event(), asyncio.Event()
        watcher = asyncio.create_task(watch(ready, done))
        await ready.wait()
        await asyncio.to_thread(forge, nats.url, bad_messages(stream)[:3])
        with Producer(stream, nats.url) as p:
            for i in range(5):
                p.publish({"i": i})
        good: list[int] = []
        seen: dict[int, int] = {}
        async with AsyncConsumer(stream, nats.url, group="g", max_ack_pending=3, ack_wait_s=0.5,
                                 max_deliver=2) as c:
            deadline = time.monotonic() + 20
            while len(good) < 5 or c.counts["dead"] < 3:  # (a loaded machine buries them after the good ones)
                assert time.monotonic() < deadline, (good, seen, c.counts)
                m = await c.receive(1)
                if m is None:
                    continue
                if m.error is None:
                    good.append(m.json()["i"])
                    await m.ack()
                else:
                    seen[m.seq] = max(seen.get(m.seq, 0), m.delivered)  # ignored: neither acked nor termed
            counts = c.counts
        done.set()
        await asyncio.wait_for(watcher, 10)
        return good, counts, seen

    good, counts, seen = asyncio.run(asyncio.wait_for(scenario(), 40))
    assert good == [0, 1, 2, 3, 4]
    assert counts["dead"] == 3 and counts["invalid"] == 6   # each forged message delivered twice, then buried
    assert seen == {1: 2, 2: 2, 3: 2}
    assert sorted(int(m.headers["Kvpool-Dead-Seq"]) for m in dead) == [1, 2, 3]
    first = min(dead, key=lambda m: int(m.headers["Kvpool-Dead-Seq"]))
    assert (first.data, first.headers["Kvpool-Dead-Kind"], first.headers["Kvpool-Dead-Consumer"]) == \
        (b"x", "bogus", "g")
    assert "max_deliver is 2" in first.headers["Kvpool-Dead-Reason"]


def test_sync_consumer_dead_letters_too(nats, stream):
    forge(nats.url, bad_messages(stream)[:1])
    with Producer(stream, nats.url) as p:
        p.publish({"i": 0})
    with Consumer(stream, nats.url, ack_wait_s=0.3, max_deliver=1) as c:
        first = c.receive(2)
        assert first.kind == "invalid" and first.delivered == 1   # not settled: comes back, then buried
        good = c.receive(2)
        assert good.json() == {"i": 0}
        good.ack()
        assert c.receive(1.5) is None
        assert c.counts["dead"] == 1


def test_callback_consumer_never_sees_invalid_messages_and_dead_letters_them_at_once(nats, stream):
    forge(nats.url, bad_messages(stream)[:4])
    with Producer(stream, nats.url) as p:
        p.publish({"i": 0})

    async def run() -> tuple[list[Any], dict[str, int]]:
        got: list[Any] = []
        async with AsyncConsumer(stream, nats.url) as c:
            handle = await c.consume(lambda m: got.append(m.json()))
            deadline = time.monotonic() + 10
            while not got or c.counts["dead"] < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await handle.stop()
            return got, c.counts

    got, counts = asyncio.run(asyncio.wait_for(run(), 20))
    assert got == [{"i": 0}] and counts == {"invalid": 4, "forged": 0, "dead": 4}


def test_with_a_stream_secret_unsigned_and_badly_signed_messages_are_forged(nats, stream, monkeypatch):
    monkeypatch.setenv("KVPOOL_STREAM_SECRET", "s3cret")
    forge(nats.url, [(f"kvpool.stream.{stream}.msg", b'{"i": "forged"}',
                      {"Kvpool-Kind": "inline", "Kvpool-Type": "json"})])
    with Producer(stream, nats.url, secret="wrong") as p:
        p.publish({"i": "wrong key"})
    with Producer(stream, nats.url) as p:        # the secret from KVPOOL_STREAM_SECRET
        p.publish({"i": 1})
    forge(nats.url, [(f"kvpool.stream.{stream}.msg", b'{"i": 1, "x": 2}',   # a signed message's body, altered
                      {"Kvpool-Kind": "inline", "Kvpool-Type": "json", "Kvpool-Sig": "0" * 64})])
    with Consumer(stream, nats.url) as c:
        got = [c.receive(2) for _ in range(4)]
        assert [m.kind for m in got] == ["invalid", "invalid", "inline", "invalid"]
        assert all(isinstance(m.error, ForgedMessage) for m in got if m.kind == "invalid")
        assert "unsigned" in str(got[0].error) and "signature is wrong" in str(got[1].error)
        assert got[2].json() == {"i": 1}
        assert c.counts["forged"] == 3
    with Consumer(stream, nats.url, secret="") as plain:    # explicitly no secret: nothing is checked
        assert [plain.receive(2).json()["i"] for _ in range(4)] == ["forged", "wrong key", 1, 1]


def test_tail_prints_forged_messages_with_their_error_and_goes_on(nats, stream, capsys):
    forge(nats.url, [*bad_messages(stream)[:2],
                     (f"kvpool.stream.{stream}.msg", b"{not json", {"Kvpool-Kind": "inline", "Kvpool-Type": "json"}),
                     (f"kvpool.stream.{stream}.msg", b'"\\udc00"', {"Kvpool-Kind": "inline", "Kvpool-Type": "json"})])
    with Producer(stream, nats.url) as p:
        p.publish({"ok": True})
    parser = argparse.ArgumentParser(prog="kvpool")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["streams", "--nats-url", nats.url, "tail", stream, "--start", "all", "--count", "5"])
    assert args.func(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["kind"], "error" in x) for x in lines] == [("invalid", True), ("invalid", True), ("inline", False),
                                                           ("inline", False), ("inline", False)]
    assert "data" not in lines[2] and lines[3]["data"] == "\udc00" and lines[4]["data"] == {"ok": True}


def test_a_producer_refuses_headers_that_cannot_be_sent_as_one_header(nats, stream):
    with Producer(stream, nats.url) as p:
        for bad in ({"a": "\ud800"}, {"a": "x\r\nKvpool-Kind: end"}, {"a b": "x"}, {"": "x"}):
            with pytest.raises(InvalidArgument, match="header"):
                p.publish(b"x", headers=bad)
        p.publish(b"x", headers={"trace-id": "é1"})
    with Consumer(stream, nats.url) as c:
        assert c.receive(2).headers["trace-id"] == "é1"


_txt = st.text(st.characters(exclude_categories=()), max_size=8)   # lone surrogates included
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _txt,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_txt, inner, max_size=4),
                     max_leaves=20)
_fields = st.fixed_dictionaries({}, optional={
    "keys": st.lists(_txt | st.fixed_dictionaries({"hex": st.text(max_size=8)}) | _json, max_size=3),
    "sizes": st.lists(st.integers() | _json, max_size=3), "checksums": st.lists(st.integers() | _json, max_size=3),
    "request": _txt | _json, "layer": st.integers() | _json, "layers": st.integers() | _json,
    "seal": st.fixed_dictionaries({"nonce": st.text(max_size=40), "n": st.integers() | _json,
                                   "reveal": st.text(max_size=70), "commit": st.text(max_size=70)}) | _json})


@settings(max_examples=400, deadline=None)
@given(body=st.binary(max_size=64) | _fields.map(lambda d: json.dumps(d).encode()) | _json.map(
    lambda d: json.dumps(d).encode()), kind=st.text(max_size=8) | st.sampled_from(["ref", "kv", "end", "inline"]))
def test_decoding_anything_is_a_value_or_a_malformed_message(body, kind):
    """What the wire can carry never raises anything but MalformedMessage, and what decodes is in bounds."""
    for decode in (lambda: Ref.decode(body), lambda: End.decode(body), lambda: kind_of({"Kvpool-Kind": kind})):
        try:
            out = decode()
        except MalformedMessage:
            continue
        if isinstance(out, Ref):
            assert 0 < len(out.keys) <= Limits().max_keys and 0 <= out.total <= Limits().max_bytes
            assert all(0 < len(k.encode() if isinstance(k, str) else k) <= 511 for k in out.keys)
