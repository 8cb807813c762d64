"""A prefill instance placing locally (`ClientConfig.placement="local"`) keeps its layers on its own node's
worker, and a decode instance on another node reads them from that worker by the announcement's places,
though placement by hash would look for some of them elsewhere. Real nats-server, two `kvpool worker`s
claiming two nodes."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.core import ConfigError, PoolClient
from kvpool.core.cluster import rank
from kvpool.streams import HandoffReceiver, Producer

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
