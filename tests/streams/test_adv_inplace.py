"""Adversarial checks of the same-node prefill->decode handoff (kvpool.streams): what a decode-side
receiver yields when its request id has an earlier, unread request stored on the stream, or when
signed messages of an earlier request are published again. Real nats-server and `kvpool worker`."""
from __future__ import annotations

import numpy as np
from handoffhelp import layer_block

from kvpool.core import PoolClient
from kvpool.streams import HandoffError, HandoffReceiver, HandoffTimeout, Producer
from kvpool.streams.admin import subject
from kvpool.streams.wire import Msg, Wire

BLOCK = 64 << 10


def _block(tag: str, layer: int) -> np.ndarray:
    return layer_block(tag, layer, BLOCK)



def _publish(url: str, stream: str, pool: PoolClient, request: str, tag: str, layers: int = 2) -> None:
    """One request of `layers` layers whose blocks are `tag`'s (keys of their own)."""
    with Producer(stream, url, pool=pool) as p:
        for layer in range(layers):
            p.publish_kv(request, layer, [f"{tag}/L{layer}"], [_block(tag, layer)])
        p.end_request(request, layers)


def _read(url: str, stream: str, pool: PoolClient, request: str) -> list[tuple[int, list[str], bytes]] | None:
    """What a fresh receiver yields for `request`; None for a typed refusal (acceptable)."""
    with HandoffReceiver(stream, url, pool) as rx:
        try:
            return [(layer, list(keys), bytes(bufs[0])) for layer, keys, bufs in rx.iter_layers(request, timeout=3)]
        except (HandoffError, HandoffTimeout):
            return None


def test_a_request_id_used_again_never_yields_an_earlier_unread_requests_layers(nats, make_stream, pool):
    """A decode engine restarted (its request ids start over) asks for request 'r'. The stream still holds
    an earlier request 'r' nobody read (its decode side died), then the new prefill's 'r'. The user sees
    the earlier request's KV handed over as this one's, with no error; expected: the new request's layers,
    or a typed HandoffError/HandoffTimeout."""
    s = make_stream()
    _publish(nats.url, s, pool, "r", "old")
    _publish(nats.url, s, pool, "r", "new")
    _expect_new_or_refused(_read(nats.url, s, pool, "r"))


def _expect_new_or_refused(got: list[tuple[int, list[str], bytes]] | None) -> None:
    if got is None:
        return
    assert [(layer, keys) for layer, keys, _ in got] == [(layer, [f"new/L{layer}"]) for layer in range(2)]
    assert [data for _, _, data in got] == [_block("new", layer).tobytes() for layer in range(2)]


def test_with_a_stream_secret_a_replayed_earlier_request_is_not_taken_for_the_new_one(nats, make_stream, pool,
                                                                                     monkeypatch):
    """KVPOOL_STREAM_SECRET is set. Request 'r' is handed off and read; someone who may read and publish
    on the stream (not knowing the secret) keeps its signed messages, and publishes them again when a
    request 'r' comes again (a retry of the same id). The user sees the earlier request's layers yielded
    as the new one's, with no error: a replayed message passes the signature check. Expected: the new
    request's layers, or a typed refusal."""
    monkeypatch.setenv("KVPOOL_STREAM_SECRET", "adv-inplace-secret")
    s = make_stream()
    wire = Wire(nats.url)
    try:
        sid = wire.subscribe(subject(s, "req", "r"))
        _publish(nats.url, s, pool, "r", "old")
        kept: list[Msg] = []
        while len(kept) < 3 and (m := wire.next(sid, 2.0)) is not None:
            kept.append(m)
        assert len(kept) == 3 and all(m.headers.get("Kvpool-Sig") for m in kept)
        assert _read(nats.url, s, pool, "r") is not None  # read whole (and purged)
        for m in kept:  # the replay, ahead of the new request's messages (its unsigned Nats-Msg-Id left out,
            # as one replaying it after the stream's duplicate window would not need to)
            wire.publish(m.subject, m.data, {k: v for k, v in m.headers.items() if k != "Nats-Msg-Id"})
        wire.flush()
    finally:
        wire.close()
    _publish(nats.url, s, pool, "r", "new")
    _expect_new_or_refused(_read(nats.url, s, pool, "r"))


def test_an_into_buffer_used_again_for_each_layer_holds_each_layer_as_it_is_yielded(nats, make_stream, pool):
    """A decode engine stages each layer in one scratch buffer (`into` returns it for every layer) and
    copies it out before asking for the next layer. When the receiver comes after the prefill (the layers
    are read back from the stream in one burst), each layer is copied into the scratch before any is
    yielded: the user sees layer 0 yielded holding layer 1's bytes, checksum-verified, with no error.
    Expected: each layer yielded holds its own bytes (or `into` is called for a layer only as it is due)."""
    s = make_stream()
    _publish(nats.url, s, pool, "r", "new")  # whole before the receiver comes
    scratch = bytearray(BLOCK)
    with HandoffReceiver(s, nats.url, pool) as rx:
        layers = rx.iter_layers("r", timeout=5, into=lambda _layer, _nbytes: scratch)
        got = [(layer, bytes(bufs[0])) for layer, _, bufs in layers]  # each copied out as it is yielded
    assert [layer for layer, _ in got] == [0, 1]
    assert [data == _block("new", layer).tobytes() for layer, data in got] == [True, True]
