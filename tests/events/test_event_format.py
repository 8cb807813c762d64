"""kvpool's event batches and their vLLM form: keys name the engine's block hash, tiers the medium,
removals merge, tier moves only when asked; bad settings and malformed batches are typed errors."""
from __future__ import annotations

import hashlib

import msgspec
import pytest

from kvpool.core.errors import ConfigError, ProtocolError
from kvpool.core.events import BlockEvent, EventBatch, subject_of
from kvpool.core.events_zmq import VllmFormat, block_hash, encode, vllm_events

from evhelp import ArrayKVEventBatch

H = "ab" * 32


def _batch(*events: tuple[str, str, str, bytes]) -> EventBatch:
    return EventBatch("w1", "n1", "b", 0, 12.5, 0, [BlockEvent(*e) for e in events])


@pytest.mark.parametrize("key,expected", [
    (f"vllm/{H}".encode(), bytes.fromhex(H)),  # kvpool's vLLM connector
    (f"Qwen3-8B/0/{H}_0_k".encode(), bytes.fromhex(H)),  # SGLang page hash, MHA part
    (f"m/{'cd' * 32}/x/{H}__k".encode(), bytes.fromhex(H)),  # the last hash names the block
    (b"lmcache@chunk-17", hashlib.sha256(b"lmcache@chunk-17").digest()),  # no hash in it
    (("ab" * 33).encode(), hashlib.sha256(("ab" * 33).encode()).digest()),  # 66 hex digits: not a hash
])
def test_block_hash_is_the_engines(key: bytes, expected: bytes) -> None:
    assert block_hash(key) == expected
    assert block_hash(key, "int") == int.from_bytes(expected, "big") & ((1 << 64) - 1)


def test_batches_round_trip_and_keep_binary_keys() -> None:
    b = _batch(("stored", "dram", "", b"k\xff\x00"), ("removed", "ssd", "evict", "ключ".encode()),
               ("cleared", "", "", b"*"))
    back = EventBatch.decode(b.encode())
    assert back == b
    assert subject_of("w.1 *>") == "kvpool.events.w_1___"


@pytest.mark.parametrize("data", [b"not json", b"{}", b'{"worker": "w", "seq": 1, "ts": 0, "events": [[1]]}'])
def test_malformed_batches_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed event batch"):
        EventBatch.decode(data)


def test_pool_level_events_by_default() -> None:
    k1, k2, k3, k4 = (f"vllm/{i:064x}".encode() for i in (1, 2, 3, 4))
    b = _batch(("stored", "dram", "", k1), ("copied", "ssd", "", k1), ("dropped", "dram", "evict", k1),
               ("stored", "dram", "", k2), ("stored", "dram", "", k3), ("removed", "ssd", "evict", k1),
               ("removed", "dram", "evict", k2), ("removed", "dram", "remove", k3),
               ("removed", "dram", "remove", k4), ("cleared", "", "", b"*"))
    ev = vllm_events(b, VllmFormat())
    assert [e["type"] for e in ev] == ["BlockStored"] * 3 + ["BlockRemoved", "BlockRemoved", "AllBlocksCleared"]
    assert ev[0]["block_hashes"] == [(1).to_bytes(32, "big")] and ev[0]["medium"] == "CPU"
    assert ev[3] == {"type": "BlockRemoved", "block_hashes": [(1).to_bytes(32, "big")], "medium": "STORAGE"}
    # merged: one medium; k4 was never announced stored, so a router is told nothing of it
    assert ev[4]["block_hashes"] == [(2).to_bytes(32, "big"), (3).to_bytes(32, "big")]


def test_tier_moves_when_asked_and_kv_parts_once() -> None:
    k = f"m/{H}_0_k".encode()
    v = f"m/{H}_0_v".encode()
    b = _batch(("stored", "dram", "", k), ("stored", "dram", "", v), ("copied", "ssd", "", k),
               ("dropped", "dram", "evict", k))
    ev = vllm_events(b, VllmFormat(tier_moves=True, block_hash="int"))
    h = int.from_bytes(bytes.fromhex(H), "big") & ((1 << 64) - 1)
    assert [(e["type"], e["block_hashes"], e["medium"]) for e in ev] == [
        ("BlockStored", [h], "CPU"), ("BlockStored", [h], "STORAGE"), ("BlockRemoved", [h], "CPU")]


def test_array_layout_decodes_as_vllms_example_subscriber_does() -> None:
    fmt = VllmFormat(layout="array", block_tokens=64)
    k = f"vllm/{H}".encode()
    payload = encode(3.5, vllm_events(_batch(("stored", "dram", "", k), ("removed", "dram", "evict", k),
                                              ("cleared", "", "", b"*")), fmt), fmt)
    batch = msgspec.msgpack.Decoder(ArrayKVEventBatch).decode(payload)
    assert batch.ts == 3.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored.block_hashes == [bytes.fromhex(H)] and stored.block_size == 64 and stored.medium == "CPU"
    assert stored.parent_block_hash is None and stored.token_ids == [] and stored.lora_id is None
    assert removed.block_hashes == [bytes.fromhex(H)] and type(cleared).__name__ == "ArrayAllBlocksCleared"


@pytest.mark.parametrize("kw,named", [({"layout": "json"}, "layout 'json'"), ({"block_hash": "hex"}, "'hex'"),
                                      ({"block_tokens": 0}, "block_tokens 0")])
def test_bad_formats_are_config_errors(kw: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        VllmFormat(**kw)


def test_queued_events_are_taken_in_bounded_batches() -> None:
    from kvpool.core.events import EventQueue

    q = EventQueue(max_queued=100)
    for i in range(120):
        q.stored(b"k" * 500 + str(i).encode(), "dram")
    assert q.lost == 20
    first = q.take(max_bytes=10_000)
    assert 1 <= len(first) <= 10 and first[0].key.endswith(b"k0")
    rest = []
    while batch := q.take(n=30):
        assert len(batch) <= 30
        rest += batch
    assert len(first) + len(rest) == 100 and rest[-1].key.endswith(b"99")
    assert len(EventBatch("w", "n", "b", 0, 0.0, 0, first).encode()) < 12_000
