"""Review of commit 59bcc34 (the handoff receiver takes the first producer chain of a request id and fails
the request on any sign of another; the stream's max_age is waited for, and asked again after a failure).
Real nats-server and `kvpool worker` (fixtures of tests/streams/conftest.py)."""
from __future__ import annotations

import concurrent.futures
import inspect
import sys
import threading
from typing import Any

import numpy as np
import pytest
from handoffhelp import layer_block, wait_stored

from kvpool.streams import (
    HandoffError,
    HandoffReceiver,
    HandoffTimeout,
    Producer,
    StreamConfig,
    StreamTimeout,
    create_stream,
    live,
)
from kvpool.streams.announcer import Announcer

BLOCK = 16 << 10


def _block(tag: str, layer: int) -> np.ndarray:
    return layer_block(tag, layer, BLOCK)



def test_an_id_read_again_after_its_own_purge_is_not_failed_by_the_earlier_requests_retried_end(
        nats, make_stream, pool, monkeypatch):
    """The prefill's `end_request('r')` is stored but its acknowledgement is lost (StreamTimeout); as the
    docstring says it may, the prefill calls it again, so the end is stored twice ("stored twice, read
    once"). The decode side reads 'r' whole, and its receiver purges it. Later the same id comes again (a
    preempted request handed off anew) and the same receiver reads 'r' again, which the README allows: "a
    receiver reading an id again waits for its own purge of the earlier one". The user sees HandoffError
    ("messages of two producer chains") for a perfectly ordinary second request: the purge stopped at the
    first copy of the end, and the second copy (of the earlier, finished chain) now counts as another
    request of the id. Before 59bcc34 the lone stray end was dropped. Expected: the new request's layers."""
    s = make_stream()
    real = Announcer.publish
    lost: list[int] = []

    def ack_lost(self: Announcer, subj: str, body: bytes, headers: dict[str, str], **kw: Any) -> int:
        seq = real(self, subj, body, headers, **kw)  # stored...
        if not lost:
            lost.append(seq)  # ...but the acknowledgement never came
            raise StreamTimeout(f"publish to stream {s!r}: not acknowledged within 5 s (injected)")
        return seq

    monkeypatch.setattr(Announcer, "publish", ack_lost)
    with Producer(s, nats.url, pool=pool) as p:
        for layer in range(2):
            p.publish_kv("r", layer, [f"old/L{layer}"], [_block("old", layer)])
        with pytest.raises(StreamTimeout):
            p.end_request("r", 2)
        p.end_request("r", 2)  # the retry the docstring allows
    monkeypatch.setattr(Announcer, "publish", real)
    wait_stored(nats.url, s, 3)  # two layers, the end once (the retry has the same duplicate id: JetStream drops it)
    with HandoffReceiver(s, nats.url, pool) as rx:
        got = [(layer, list(keys)) for layer, keys, _ in rx.iter_layers("r", timeout=3)]
        assert got == [(0, ["old/L0"]), (1, ["old/L1"])]
        with Producer(s, nats.url, pool=pool) as p:  # the id comes again
            for layer in range(2):
                p.publish_kv("r", layer, [f"new/L{layer}"], [_block("new", layer)])
            p.end_request("r", 2)
        try:
            again = [(layer, list(keys), bytes(bufs[0])) for layer, keys, bufs in rx.iter_layers("r", timeout=3)]
        except (HandoffError, HandoffTimeout) as e:
            pytest.fail(f"the id's new request failed on the earlier one's leftover end: {e!r}")
    assert again == [(layer, [f"new/L{layer}"], _block("new", layer).tobytes()) for layer in range(2)]


def test_two_threads_reading_one_receiver_never_get_a_raw_exception_from_the_max_age_check(nats, pool):
    """A decode engine shares one HandoffReceiver between two threads, each reading its own request (the
    Wire it reads on serves any number of threads). The receiver was made before its stream, so the
    stream's max_age is not known yet, and the first message of thread A waits for the ask
    (`Retention.max_age_s`). Thread B's first message arrives as that ask is answered and settles it. The
    user sees thread A's `iter_layers` raise AttributeError ('NoneType' object has no attribute
    '_condition') out of `concurrent.futures.wait([None])`: `max_age_s` reads `self._asking` again after
    checking it, and another thread set it to None in between. The interleaving is forced here with a
    line trace in thread A (it happens by itself, more rarely). Expected: both requests' layers."""
    src, start = inspect.getsourcelines(live.Retention.max_age_s)
    line = start + next(i for i, text in enumerate(src) if "concurrent.futures.wait([" in text)  # (its wait)
    paused, resume = threading.Event(), threading.Event()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not live.Retention.max_age_s.__code__:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno == line and not paused.is_set():
                paused.set()  # thread A checked `self._asking is not None` and is about to wait on it
                resume.wait(10)
            return local
        return local

    name = "shared_rx"
    with HandoffReceiver(name, nats.url, pool) as rx:
        first = rx._retention._asking  # the ask made with the receiver (no stream yet) has failed
        if first is not None:
            concurrent.futures.wait([first], 5)
        create_stream(nats.url, name, StreamConfig())
        result: dict[str, Any] = {}

        def thread_a() -> None:
            sys.settrace(tracer)
            try:
                result["a"] = [layer for layer, _, _ in rx.iter_layers("a", timeout=5)]
            except BaseException as e:  # what escaped iter_layers
                result["a"] = e
            finally:
                sys.settrace(None)

        a = threading.Thread(target=thread_a, daemon=True)
        a.start()
        try:
            with Producer(name, nats.url, pool=pool) as p:
                p.publish_kv("a", 0, ["a/L0"], [_block("a", 0)])
                p.end_request("a", 1)
                assert paused.wait(5), "thread A never waited for the stream's max_age"
                asking = rx._retention._asking
                concurrent.futures.wait([asking], 5)  # the ask thread A waits for is answered
                p.publish_kv("b", 0, ["b/L0"], [_block("b", 0)])
                p.end_request("b", 1)
            assert [layer for layer, _, _ in rx.iter_layers("b", timeout=5)] == [0]  # thread B settles it
        finally:
            resume.set()
            a.join(10)
    got = result.get("a")
    assert not isinstance(got, BaseException) or isinstance(got, (HandoffError, HandoffTimeout)), \
        f"iter_layers raised {got!r}"
    assert got == [0]
