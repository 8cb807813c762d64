"""A prefill instance placing locally (`ClientConfig.placement="local"`) keeps its layers on its own node's
worker, and a decode instance on another node reads them from that worker by the announcement's places,
though placement by hash would look for some of them elsewhere. Real nats-server, two `kvpool worker`s
claiming two nodes."""
from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core import ConfigError, InvalidArgument, Place, PoolClient, checksum, get_placed
from kvpool.core.cluster import rank
from kvpool.streams import HandoffReceiver, Producer
from kvpool.streams.envelope import Ref
from kvpool.streams.payload import fetch

LAYERS, BLOCKS, BLOCK = 4, 4, 64 << 10
PREFILL, DECODE = "prefill-node", "decode-node"


def _blocks(layer: int) -> list[np.ndarray]:
    rng = np.random.default_rng(layer)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]


def _keys(request: str, layer: int) -> list[str]:
    return [f"{request}/L{layer}/b{i}" for i in range(BLOCKS)]


@pytest.fixture
def two_nodes(nats, spawn) -> Iterator[tuple[str, str, PoolClient, PoolClient]]:
    """(prefill worker's id, decode worker's id, a locally placing client on the prefill node, a client
    placing by hash on the decode node)."""
    spawn(nats_url=nats.url, node_id=PREFILL)
    spawn(nats_url=nats.url, node_id=DECODE)
    with PoolClient(mode="cluster", nats_url=nats.url, node_id=PREFILL, placement="local") as prefill, \
            PoolClient(mode="cluster", nats_url=nats.url, node_id=DECODE) as decode:
        for c in (prefill, decode):
            assert c.wait_for_members(lambda m: len(m) == 2, 15)
        ids = {info.node_id: w for w, info in decode.members().items()}
        yield ids[PREFILL], ids[DECODE], prefill, decode


def test_layers_stay_on_the_prefill_node_and_reach_a_decode_node_by_their_places(nats, make_stream,
                                                                                 two_nodes) -> None:
    prefill_id, decode_id, prefill, decode = two_nodes
    s = make_stream()
    with Producer(s, nats.url, pool=prefill) as p:
        for layer in range(LAYERS):
            p.publish_kv("r1", layer, _keys("r1", layer), _blocks(layer))
        p.end_request("r1", LAYERS)
    keys = [k for layer in range(LAYERS) for k in _keys("r1", layer)]
    by_hash = {k: rank(k.encode(), [prefill_id, decode_id])[0] for k in keys}
    assert set(by_hash.values()) == {prefill_id, decode_id}  # both workers own some by hash
    stats = {w: s.cache.dram_blocks if s.cache else None for w, s in decode.stats().workers.items()}
    assert stats == {prefill_id: len(keys), decode_id: 0}  # every block on the prefill node's worker
    # a client placing by hash finds only the keys hashing to the prefill node's worker by their names
    assert decode.batch_exists(keys) == [by_hash[k] == prefill_id for k in keys]

    with HandoffReceiver(s, nats.url, decode) as rx:
        got = [(layer, [bytes(b) for b in bufs]) for layer, _, bufs in rx.iter_layers("r1", timeout=20)]
    assert got == [(layer, [b.tobytes() for b in _blocks(layer)]) for layer in range(LAYERS)]
    assert (rx.counts["in_place"], rx.counts["from_pool"]) == (0, len(keys))  # another node: all over TCP


def test_local_placement_without_a_worker_on_the_node_places_by_hash(nats, spawn) -> None:
    spawn(nats_url=nats.url, node_id=PREFILL)
    spawn(nats_url=nats.url, node_id=DECODE)
    keys = [f"k{i}" for i in range(32)]
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="no-worker-here", placement="local") as lone, \
            PoolClient(mode="cluster", nats_url=nats.url, node_id=DECODE) as by_hash:
        for c in (lone, by_hash):
            assert c.wait_for_members(lambda m: len(m) == 2, 15)
        lone.batch_put(keys, [k.encode() for k in keys])
        assert by_hash.batch_exists(keys) == [True] * len(keys)  # where hashing puts them
        assert all(s.cache and s.cache.dram_blocks > 0 for s in by_hash.stats().workers.values())


def test_an_unknown_placement_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="placement 'nearby'"):
        PoolClient(mode="cluster", nats_url="nats://127.0.0.1:1", placement="nearby")


@pytest.mark.parametrize("op", ["put", "remove"])
def test_a_key_written_while_the_node_had_no_worker_is_not_served_old_once_its_worker_leaves(nats, spawn,
                                                                                            op) -> None:
    """A locally placing client on a node without a worker places by hash; once its node has a worker,
    its writes go there, and the workers that took the key by hash are told of them: when the node's
    worker leaves again, they serve no old bytes (a removal stays removed)."""
    spawn(nats_url=nats.url, node_id="X")
    spawn(nats_url=nats.url, node_id="Y")
    keys = [f"k{i}" for i in range(48)]
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="P", placement="local") as c, \
            PoolClient(mode="cluster", nats_url=nats.url, node_id="D") as by_hash:
        assert c.wait_for_members(lambda m: len(m) == 2, 15)
        c.batch_put(keys, [b"old-" + k.encode() for k in keys])  # no worker on P: by hash, to X and Y
        here = spawn(nats_url=nats.url, node_id="P")
        for client in (c, by_hash):
            assert client.wait_for_members(lambda m: len(m) == 3, 15)
        if op == "put":
            c.batch_put(keys, [b"new-" + k.encode() for k in keys])
        else:
            c.batch_remove(keys)
        deadline = time.monotonic() + 10  # X and Y are told in the background
        while any(by_hash.batch_exists([k for k in keys if rank(k.encode(), list(c.members()))[0] != _id(c, "P")]))\
                and time.monotonic() < deadline:
            time.sleep(0.05)
        here.stop()
        assert c.wait_for_members(lambda m: len(m) == 2, 20)
        got = [c.get(k) for k in keys]
    assert [g for g in got if g is not None and g.startswith(b"old-")] == []


def _id(c: PoolClient, node: str) -> str:
    return next(w for w, info in c.members().items() if info.node_id == node)


def test_local_placement_refuses_copies() -> None:
    with pytest.raises(ConfigError, match="placement 'local' keeps one copy"):
        PoolClient(mode="cluster", nats_url="nats://127.0.0.1:1", placement="local", replication=2)


def test_get_placed_wants_one_place_per_block(two_nodes) -> None:
    *_, decode = two_nodes
    with pytest.raises(InvalidArgument, match="1 keys, 1 buffers and 2 places"):
        get_placed(decode, ["k"], [memoryview(bytearray(8))], [None, None])


def test_a_place_naming_a_worker_with_other_bytes_falls_back_to_the_owners(two_nodes) -> None:
    prefill_id, decode_id, _, decode = two_nodes
    key = next(f"k{i}" for i in range(100) if rank(f"k{i}".encode(), [prefill_id, decode_id])[0] == decode_id)
    block = np.arange(4096, dtype=np.uint8)
    decode.put(key, block)  # to its owner by hash: the decode node's worker
    info = decode.members()[prefill_id]
    with PoolClient(mode="local", worker=info.tcp) as other:
        other.put(key, np.zeros(4096, dtype=np.uint8))  # other bytes under the key where the place points
    ref = Ref([key], [block.size], [checksum(block)], places=[Place(prefill_id, info.arena, 0, block.size, 1)])
    whole, _ = fetch(decode, ref)
    assert bytes(whole) == block.tobytes()
