"""Adversarial checks of kvpool.streams (each test names the bug it shows): typed errors for bad input,
the handoff's consistency checks, announcements the producer can make but the server or the receiver
cannot take, a request id used again after its end, and the CLI's errors as one line. Against a real
nats-server and `kvpool worker`, as the other stream tests."""
from __future__ import annotations

import asyncio
import hashlib
import io
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvpool.core import KVPoolError, PoolClient
from kvpool.core.cli import EXIT_ERROR
from kvpool.core.cli import main as kvpool_main
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.streams import (
    AsyncConsumer,
    Consumer,
    HandoffError,
    HandoffReceiver,
    HandoffTimeout,
    Producer,
    StreamConfig,
    StreamUnavailable,
    create_stream,
    delete_stream,
    stream_info,
)

BLOCK = 64 << 10


def _block(request: str, layer: int) -> np.ndarray:
    return np.random.default_rng([sum(request.encode()), layer]).integers(0, 256, BLOCK, dtype=np.uint8)



def _typed_or(value: Any, call: Any) -> None:
    """`call()` returns `value` or raises a KVPoolError; anything else escaping is the bug."""
    try:
        got = call()
    except KVPoolError:
        return
    assert got == value


# Bug: Consumer/AsyncConsumer.receive(0) or a negative timeout raises nats-py's raw ValueError('invalid fetch timeout').
def test_receive_with_a_zero_or_negative_timeout_is_none_not_a_raw_value_error(nats, make_stream):
    s = make_stream()
    with Consumer(s, nats.url) as c:
        for timeout in (0, 0.0, -1.0):
            _typed_or(None, lambda t=timeout: c.receive(t))

    async def poll() -> None:
        async with AsyncConsumer(s, nats.url) as ac:
            for timeout in (0, -1.0):
                try:
                    assert await ac.receive(timeout) is None
                except KVPoolError:
                    pass
    asyncio.run(asyncio.wait_for(poll(), 20))


# Bug: stream_info/delete_stream of a bad name, NaN/inf max_age_s or ack_wait_s raise raw ValueError/OverflowError.
def test_bad_names_and_non_finite_durations_are_typed_errors(nats, make_stream):
    s = make_stream()
    for name in ("bad.name", "a*b", ""):
        with pytest.raises(KVPoolError):
            stream_info(nats.url, name)
        with pytest.raises(KVPoolError):
            delete_stream(nats.url, name)
    for bad in (math.nan, math.inf):
        with pytest.raises(KVPoolError):
            create_stream(nats.url, "nonfinite", StreamConfig(max_age_s=bad))
        with pytest.raises(KVPoolError):
            Consumer(s, nats.url, ack_wait_s=bad).close()


def _publish(url: str, stream: str, pool: PoolClient, request: str, layers: list[int], end: int | None = None) -> None:
    with Producer(stream, url, pool=pool) as p:
        for layer in layers:
            p.publish_kv(request, layer, [f"{request}/L{layer}"], [_block(request, layer)])
        p.end_request(request, len(layers) if end is None else end)


# Layers are numbered by their producer (0 to Limits.max_layer, a pipeline stage's own, say); the end counts
# them, and the receiver hands out exactly those published, each once.
def test_layers_are_the_producers_numbers_and_the_end_counts_them(nats, make_stream, pool):
    s = make_stream()
    _publish(nats.url, s, pool, "holes", [0, 1, 5])
    with HandoffReceiver(s, nats.url, pool) as rx:
        got = [(layer, bytes(bufs[0])) for layer, _, bufs in rx.iter_layers("holes", timeout=10)]
    assert got == [(layer, _block("holes", layer).tobytes()) for layer in (0, 1, 5)]


# Bug: publish_kv with no blocks is announced, every receiver drops it as malformed, the ended request times out.
def test_a_layer_of_no_blocks_is_refused_by_the_producer_or_taken_by_the_receiver(nats, make_stream, pool):
    s = make_stream()
    refused = False
    with Producer(s, nats.url, pool=pool) as p:
        try:
            p.publish_kv("empty", 0, [], [])
        except KVPoolError:
            refused = True  # refused at once: announced nothing, so layer 0 is published again below
        p.publish_kv("empty", 0 if refused else 1, ["empty/L1"], [_block("empty", 1)])
        p.end_request("empty")
    with HandoffReceiver(s, nats.url, pool) as rx:
        got = [(layer, len(keys)) for layer, keys, _ in rx.iter_layers("empty", timeout=5)]
    assert got == ([(0, 1)] if refused else [(0, 0), (1, 1)])


# Bug: a non-contiguous `into` buffer makes iter_layers raise a raw TypeError from memoryview.cast.
def test_an_into_buffer_that_is_not_contiguous_is_a_typed_error(nats, make_stream, pool):
    s = make_stream()
    _publish(nats.url, s, pool, "cols", [0, 1])
    kv = np.zeros((BLOCK, 2), dtype=np.uint8)
    with HandoffReceiver(s, nats.url, pool) as rx, pytest.raises(KVPoolError):
        for _ in rx.iter_layers("cols", timeout=10, into=lambda layer, nbytes: kv[:, layer]):
            pass


# Bug: a layer announcement over NATS max_payload (9000 hex keys) fails as retryable StreamTimeout, not StreamRefused.
def test_an_announcement_over_the_servers_max_payload_is_delivered_or_refused_not_unavailable(
        nats, make_stream, pool):
    s = make_stream()
    n = 9000
    keys = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(n)]
    blocks = [np.full(16, i % 251, dtype=np.uint8) for i in range(n)]
    err: BaseException | None = None
    with Producer(s, nats.url, pool=pool, timeout_s=2) as p:
        try:
            p.publish_kv("long", 0, keys, blocks)
            p.end_request("long", 1)
        except KVPoolError as e:
            err = e
    if err is not None:
        assert not isinstance(err, StreamUnavailable), f"a retryable error for what no retry can send: {err!r}"
        return
    with HandoffReceiver(s, nats.url, pool) as rx:
        got = [(layer, len(k)) for layer, k, _ in rx.iter_layers("long", timeout=10)]
    assert got == [(0, n)]


# Bug: a request id reused while its first run's background purge is under way yields the OLD layers' bytes, no error.
def test_a_request_id_used_again_after_its_end_never_yields_the_old_requests_layers(nats, make_stream, pool,
                                                                                      monkeypatch):
    from kvpool.streams import handoff

    real = handoff.purge_upto

    def slow_purge(*args: Any, **kwargs: Any) -> int:
        time.sleep(3)  # (close() waits for it)
        return real(*args, **kwargs)

    monkeypatch.setattr(handoff, "purge_upto", slow_purge)
    s = make_stream()
    _publish(nats.url, s, pool, "again", [0, 1])
    new = [np.full(BLOCK, 7 + layer, dtype=np.uint8) for layer in range(2)]
    with HandoffReceiver(s, nats.url, pool) as rx:
        assert [layer for layer, _, _ in rx.iter_layers("again", timeout=10)] == [0, 1]
        with Producer(s, nats.url, pool=pool) as p:
            for layer in range(2):
                p.publish_kv("again", layer, [f"again-new/L{layer}"], [new[layer]])
            p.end_request("again", 2)
        try:
            got = [(layer, keys, [bytes(b) for b in bufs]) for layer, keys, bufs in rx.iter_layers("again", timeout=5)]
        except (HandoffError, HandoffTimeout):
            return  # a typed failure is acceptable; the old bytes are not
    assert got == [(layer, [f"again-new/L{layer}"], [new[layer].tobytes()]) for layer in range(2)]


# Bug: a Consumer whose stream was deleted gets StreamUnavailable ('NATS unavailable') for ever, not StreamNotFound.
def test_a_consumer_whose_stream_was_deleted_gets_stream_not_found(nats, make_stream):
    from kvpool.streams import StreamNotFound

    s = make_stream()
    with Producer(s, nats.url) as p:
        p.publish({"i": 0})
    with Consumer(s, nats.url) as c, Consumer(s, nats.url, group="g") as g:
        c.receive(5).ack()
        g.receive(5).ack()
        delete_stream(nats.url, s)
        for consumer in (c, g):
            with pytest.raises(StreamNotFound):
                consumer.receive(1)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = kvpool_main(list(argv))
    return code, capsys.readouterr().err


# Bug: `kvpool streams` pub/info/rm/create/tail with bad input escape as tracebacks, not one line and exit status 2.
@pytest.mark.parametrize("argv", [
    ("pub", "{s}", "not json", "--json"),
    ("pub", "{s}", "--file", "/nonexistent/kvpool-adv"),
    ("pub", "{s}", "--file", "/tmp"),
    ("info", "bad.name"),
    ("rm", "bad.name"),
    ("create", "{s}", "--max-age-s", "nan"),
    ("create", "{s}", "--max-age-s", "inf"),
    ("tail", "{s}", "--idle-s", "-1", "--count", "1"),
], ids=["pub-json", "pub-missing-file", "pub-folder", "info-dotted", "rm-dotted",
        "create-nan", "create-inf", "tail-negative-idle"])
def test_cli_bad_input_is_one_line_and_exit_2(nats, make_stream, capsys, monkeypatch, argv):
    s = make_stream()
    code, err = _cli(capsys, "streams", "--nats-url", nats.url, *(a.format(s=s) for a in argv))
    assert code == EXIT_ERROR, err
    assert "Traceback" not in err and "kvpool streams: " in err, err




# Bug: `kvpool streams pub NAME` took stdin as UTF-8 text (a traceback for other bytes): its bytes go as they are.
def test_cli_pub_publishes_stdins_bytes_as_they_are(nats, make_stream, capsys, monkeypatch):
    s = make_stream()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe\x00binary")))
    code, err = _cli(capsys, "streams", "--nats-url", nats.url, "pub", s)
    assert code == 0, err
    with Consumer(s, nats.url) as c:
        assert c.receive(5).data == b"\xff\xfe\x00binary"


# A burst read back (a request whose producer finished first: thousands of layers, each up to Limits.max_bytes)
# was fetched whole before the first layer went out: with buffers of its own per layer, the receiver held
# all of it at once. It goes in runs of at most one message's bound.
def test_a_burst_is_fetched_in_runs_of_at_most_one_messages_bytes() -> None:
    from types import SimpleNamespace

    from kvpool.streams.payload import by_bytes

    refs = [SimpleNamespace(total=t) for t in (400, 400, 300, 900, 1500, 1, 1)]
    runs = [[r.total for r in run] for run in by_bytes(refs, 1000)]  # type: ignore[arg-type]
    assert runs == [[400, 400], [300], [900], [1500], [1, 1]]


# ----- a review of the streams fixes above ------------------------------------------------------

# Bug: a request whose end came LIVE is purged without bound when the id's next request is already stored
# (stored_last is not the end for 1 s, then purge_stream(subject) with no seq): the next request is lost.
# And (a third review): that purge waited 1 s before it looked for the end, so a receiver reading the id again
# with a timeout under a second gave up on a request stored whole.
@pytest.mark.parametrize("timeout", [5.0, 0.8])
def test_purge_of_a_live_end_keeps_the_next_request_of_the_same_id(nats, make_stream, pool, timeout):
    s = make_stream()
    old = [np.full(BLOCK, 1 + layer, dtype=np.uint8) for layer in range(2)]
    new = [np.full(BLOCK, 7 + layer, dtype=np.uint8) for layer in range(2)]

    def produce() -> None:
        time.sleep(1.0)  # the receiver is subscribed: the first request comes live
        with Producer(s, nats.url, pool=pool) as p:
            for layer in range(2):
                p.publish_kv("rid", layer, [f"rid-old/L{layer}"], [old[layer]])
            p.end_request("rid", 2)
            for layer in range(2):  # the prefill side's next request of this id, right after
                p.publish_kv("rid", layer, [f"rid-new/L{layer}"], [new[layer]])
            p.end_request("rid", 2)

    t = threading.Thread(target=produce)
    with HandoffReceiver(s, nats.url, pool) as rx:
        t.start()
        first = []
        for layer, _keys, _bufs in rx.iter_layers("rid", timeout=10):
            first.append(layer)
            if layer == 1:
                t.join(20)  # the second request is stored before the first one's end is taken (live)
        assert first == [0, 1]
        try:
            got = [(layer, keys, [bytes(b) for b in bufs])
                   for layer, keys, bufs in rx.iter_layers("rid", timeout=timeout)]
        except (HandoffError, HandoffTimeout) as e:
            pytest.fail(f"the second request of the id was purged with the first: {e!r}")
    assert got == [(layer, [f"rid-new/L{layer}"], [new[layer].tobytes()]) for layer in range(2)]


@pytest.fixture
def small_pool(spawn: Callable[..., WorkerProcess], nats: NatsServer):
    """A pool of one 32 MiB worker without SSD: an evicted block is gone."""
    spawn(nats_url=nats.url, dram_bytes="32MiB")
    with PoolClient(mode="cluster", nats_url=nats.url) as c:
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        yield c


# Bug: a layer whose announcement is over the server's max_payload is now refused by Wire.publish inside
# Announcer.send (StreamRefused, synchronously), which skips the refusal path that unpins (`_on_refused`):
# the layer's blocks, put pinned, stay pinned for pin_ttl_s although nothing can ever read them.
def test_a_layer_refused_for_max_payload_leaves_its_blocks_unpinned(nats, make_stream, small_pool):
    from kvpool.streams import StreamRefused

    s = make_stream()
    n = 2200  # keys of 500 bytes: an announcement of about 1.1 MB, over nats-server's 1 MiB max_payload
    keys = [f"{i:06d}-" + "k" * 493 for i in range(n)]
    blocks = [np.full(4096, i % 251, dtype=np.uint8) for i in range(n)]
    with Producer(s, nats.url, pool=small_pool, pin_ttl_s=600) as p:
        with pytest.raises(StreamRefused):
            p.publish_kv("big", 0, keys, blocks)
        deadline = time.monotonic() + 10  # (a pin or unpin is not waited for by the call)
        while (pins := small_pool.stats().total.pins) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert pins == 0, f"{pins} blocks of a layer that was never announced are still pinned"


# Bug: iter_layers of a request id whose earlier run's purge is under way first waits for that purge,
# up to the link's timeout_s + 2 s, outside its own `timeout`: with NATS gone, a receiver reading the id
# again (an engine's retry) blocks about 6 s, not "t + LOOK_S" as handoff.LOOK_S promises.
def test_reading_an_id_again_with_nats_gone_gives_up_near_its_own_timeout(nats, make_stream, pool):
    from kvpool.streams import StreamUnavailable, handoff

    s = make_stream()
    with Producer(s, nats.url, pool=pool) as p:
        for layer in range(2):
            p.publish_kv("gone", layer, [f"gone/L{layer}"], [np.full(BLOCK, layer, dtype=np.uint8)])
        p.end_request("gone", 2)
    rx = HandoffReceiver(s, nats.url, pool)
    try:
        for layer, _, _ in rx.iter_layers("gone", timeout=10):
            if layer == 1:
                nats.stop()  # the end is in hand: its purge starts with NATS gone
        t = time.monotonic()
        with pytest.raises((TimeoutError, StreamUnavailable, HandoffTimeout)):
            next(iter(rx.iter_layers("gone", timeout=1.0)))
        waited = time.monotonic() - t
    finally:
        rx.close()
    assert waited < 1.0 + 3 * handoff.LOOK_S, f"gave up after {waited:.2f} s"


# Bug: `kvpool streams pub NAME DATA` encodes DATA with strict UTF-8 (`args.data.encode()`): an argument
# that is not UTF-8 (Python's argv holds it with surrogateescape) is refused as "--json: the data is not
# JSON" although --json was not given, instead of publishing its bytes (os.fsencode) as stdin's are.
def test_cli_pub_publishes_a_non_utf8_argument_as_its_bytes(nats, make_stream, capsys):
    from kvpool.core.cli import main as kvpool_main
    from kvpool.streams import Consumer

    s = make_stream()
    code = kvpool_main(["streams", "--nats-url", nats.url, "pub", s, "caf\udce9"])  # argv of b"caf\xe9"
    err = capsys.readouterr().err
    assert code == 0, err
    with Consumer(s, nats.url) as c:
        assert c.receive(5).data == b"caf\xe9"
