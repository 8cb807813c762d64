"""The handoff on one node reads the producer's committed blocks in place (no round trip to the worker);
a place it cannot trust (a slot reused since, an offset outside the arena, a receiver on another node)
falls back to the pool's get and still yields the producer's bytes. Real nats-server and `kvpool worker`."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.core import Place, PoolClient, put_placed
from kvpool.streams import HandoffReceiver, MalformedMessage, Producer, producer
from kvpool.streams.envelope import Ref

LAYERS, BLOCKS, BLOCK = 4, 2, 128 << 10


def _blocks(request: str, layer: int) -> list[np.ndarray]:
    rng = np.random.default_rng([sum(request.encode()), layer])
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]


def _keys(request: str, layer: int) -> list[str]:
    return [f"{request}/L{layer}/b{i}" for i in range(BLOCKS)]


@pytest.fixture
def pools(nats, worker) -> Iterator[Callable[..., PoolClient]]:
    """pools(**ClientConfig options) -> a cluster client of the one worker (closed at the end)."""
    made: list[PoolClient] = []

    def make(**kw: Any) -> PoolClient:
        c = PoolClient(mode="cluster", nats_url=nats.url, **kw)
        made.append(c)
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        return c
    yield make
    for c in made:
        c.close()


def _served(pool: PoolClient) -> int:
    """Reads the worker served (hits and misses): a read in place makes none."""
    total = pool.stats().total
    return total.hits_dram + total.hits_ssd + total.misses


def _hand_off(url: str, stream: str, pool: PoolClient, request: str,
              before_read: Callable[[], None] = lambda: None) -> None:
    with Producer(stream, url, pool=pool) as p:
        for layer in range(LAYERS):
            p.publish_kv(request, layer, _keys(request, layer), _blocks(request, layer))
        p.end_request(request, LAYERS)
    before_read()


def _receive(url: str, stream: str, pool: PoolClient, request: str) -> dict[str, int]:
    """Receive the request and check every layer is the producer's, byte for byte; the receiver's counts."""
    with HandoffReceiver(stream, url, pool) as rx:
        got = [(layer, [bytes(b) for b in bufs]) for layer, _, bufs in rx.iter_layers(request, timeout=20)]
    assert got == [(layer, [b.tobytes() for b in _blocks(request, layer)]) for layer in range(LAYERS)]
    return rx.counts


def test_a_receiver_on_the_producers_node_reads_every_block_in_place(nats, make_stream, pools) -> None:
    s = make_stream()
    producer_pool, decode_pool = pools(), pools()
    _hand_off(nats.url, s, producer_pool, "r1")
    before = _served(decode_pool)
    counts = _receive(nats.url, s, decode_pool, "r1")
    assert _served(decode_pool) == before  # no LEASE and no GET: every block read from the mapping
    assert (counts["in_place"], counts["from_pool"]) == (LAYERS * BLOCKS, 0)


def test_a_slot_reused_since_the_announcement_falls_back_to_the_pool(nats, make_stream, pools, monkeypatch) -> None:
    s = make_stream()
    producer_pool, decode_pool = pools(), pools()
    layer0 = _keys("r2", 0)
    announced: list[Place | None] = []
    real = producer.put_blocks

    def record(pool: PoolClient, keys: list[str], *a: Any, **kw: Any) -> Ref:
        ref = real(pool, keys, *a, **kw)
        announced.extend(ref.places or [] if list(keys) == layer0 else [])
        return ref

    def reuse() -> None:  # the blocks of layer 0 leave their slots, others take them, then they come back
        producer_pool.batch_remove(layer0)
        others = put_placed(producer_pool, ["other/0", "other/1"], _blocks("x", 9))
        assert {p.offset for p in others if p is not None} == {p.offset for p in announced if p is not None}
        producer_pool.batch_put(layer0, _blocks("r2", 0))

    monkeypatch.setattr(producer, "put_blocks", record)
    _hand_off(nats.url, s, producer_pool, "r2", before_read=reuse)
    before = _served(decode_pool)
    counts = _receive(nats.url, s, decode_pool, "r2")
    assert _served(decode_pool) > before  # the reused slots failed their checksums: got from the worker
    assert (counts["in_place"], counts["from_pool"]) == ((LAYERS - 1) * BLOCKS, BLOCKS)


def test_an_offset_outside_the_arena_is_never_read(nats, make_stream, pools, monkeypatch) -> None:
    """A producer's message may be forged (no stream secret) or wrong: its places only ever steer a read
    within the receiver's own mapping, and a checksum decides."""
    s = make_stream()
    producer_pool, decode_pool = pools(), pools()
    real = producer.put_blocks
    forged = [1 << 62, (64 << 20) - 1000, 12345]

    def put_blocks(*a: Any, **kw: Any) -> Ref:
        ref = real(*a, **kw)
        return dataclasses.replace(ref, places=[
            None if p is None else dataclasses.replace(p, offset=forged[(p.offset // BLOCK) % len(forged)])
            for p in ref.places or []])

    monkeypatch.setattr(producer, "put_blocks", put_blocks)
    _hand_off(nats.url, s, producer_pool, "r3")
    before = _served(decode_pool)
    counts = _receive(nats.url, s, decode_pool, "r3")
    assert _served(decode_pool) > before
    assert (counts["in_place"], counts["from_pool"]) == (0, LAYERS * BLOCKS)


def test_a_receiver_on_another_node_gets_the_blocks_from_the_pool(nats, make_stream, pools) -> None:
    s = make_stream()
    producer_pool, remote_pool = pools(), pools(node_id="another-node")  # reaches the worker over TCP
    _hand_off(nats.url, s, producer_pool, "r4")
    before = _served(remote_pool)
    counts = _receive(nats.url, s, remote_pool, "r4")
    assert _served(remote_pool) > before
    assert (counts["in_place"], counts["from_pool"]) == (0, LAYERS * BLOCKS)


def test_places_travel_in_the_message_and_malformed_ones_are_refused() -> None:
    places = [Place("w1", "kvpool-arena", 4096, 10, 7), None, Place("w2", "arena-2", 0, 30, 1),
              Place("w1", "kvpool-arena", 8192, 40, 8)]
    ref = Ref(["a", "b", "c", "d"], [10, 20, 30, 40], [1, 2, 3, 4], "r", 0, None, places)
    body = json.loads(ref.encode())
    assert body["arenas"] == [["w1", "kvpool-arena"], ["w2", "arena-2"]]  # each arena named once
    assert Ref.decode(ref.encode()).places == places
    good, named = body["at"], body["arenas"]
    bad_at = [good[:3], "no"] + [[p, None, None, None] for p in ([0, -1, 1], [2, 1, 1], [0, "1", 1], [0, 1])]
    bad_arenas = [None, [["", "arena"]], [["w1", "a" * 300]], [["w1"]], []]
    for at, arenas in [(a, named) for a in bad_at] + [(good, a) for a in bad_arenas]:
        bad = {**body, "at": at, "arenas": arenas}
        with pytest.raises(MalformedMessage):
            Ref.decode(json.dumps(bad).encode())
