"""Workers registered in NATS; clients place keys by rendezvous hashing, with replicas."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool.core.client import PoolClient
from kvpool.core.cluster import rank
from kvpool.core.errors import BlockTooLarge


def _block(i: int) -> bytes:
    return np.random.default_rng(1000 + i).integers(0, 256, 32 << 10, dtype=np.uint8).tobytes()


def _wait_members(client: PoolClient, n: int, timeout: float = 15.0) -> None:
    assert client.wait_for_members(lambda m: len(m) == n, timeout), client.members()


def test_join_and_leave_move_about_one_nth_of_the_keys():
    keys = [f"key-{i}".encode() for i in range(20000)]
    four = [f"w{i}" for i in range(4)]
    five = four + ["w4"]
    before = {k: rank(k, four)[0] for k in keys}
    after = {k: rank(k, five)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert 0.15 < len(moved) / len(keys) < 0.25  # ~1/5
    assert all(after[k] == "w4" for k in moved)  # keys only move to the newcomer
    back = {k: rank(k, four)[0] for k in keys}
    assert back == before  # and leaving moves exactly those back


def test_replication_two_survives_kill_9_of_a_worker(nats, spawn):
    workers = [spawn(nats_url=nats.url, node_id=f"node{i}") for i in range(2)]
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, node_id="client-node", timeout_s=3) as c:
        _wait_members(c, 2)
        keys = [f"r{i}" for i in range(40)]
        c.batch_put(keys, [_block(i) for i in range(40)])
        per_worker = {w: s.cache.dram_blocks for w, s in c.stats().workers.items() if s.cache is not None}
        assert sorted(per_worker.values()) == [40, 40]
        workers[0].kill()
        t = time.monotonic()
        bufs = [bytearray(32 << 10) for _ in keys]
        assert c.batch_get_into(keys, bufs) == [32 << 10] * 40
        assert time.monotonic() - t < 5
        assert [bytes(b) for b in bufs] == [_block(i) for i in range(40)]
        assert c.batch_exists(keys) == [True] * 40


def test_replication_one_dead_owner_is_a_miss_not_an_error(nats, spawn):
    workers = [spawn(nats_url=nats.url, node_id=f"node{i}") for i in range(2)]
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="client-node", timeout_s=3) as c:
        _wait_members(c, 2)
        keys = [f"s{i}" for i in range(40)]
        c.batch_put(keys, [_block(i) for i in range(40)])
        workers[1].kill()
        bufs = [bytearray(32 << 10) for _ in keys]
        sizes = c.batch_get_into(keys, bufs)
        assert 0 < sizes.count(-1) < 40
        for i, n in enumerate(sizes):
            if n >= 0:
                assert bytes(bufs[i]) == _block(i)


def test_same_node_workers_are_reached_through_shared_memory(nats, spawn):
    spawn(nats_url=nats.url, node_id="here")
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="here") as c:
        _wait_members(c, 1)
        c.put("z", b"payload")
        assert c.get("z") == b"payload"
        (transport,) = c.backend.fanout.connected().values()  # type: ignore[attr-defined]
        assert type(transport).__name__ == "ShmTransport"


def test_graceful_leave_and_join_update_members(nats, spawn):
    a = spawn(nats_url=nats.url)
    with PoolClient(mode="cluster", nats_url=nats.url) as c:
        _wait_members(c, 1)
        b = spawn(nats_url=nats.url)
        _wait_members(c, 2)
        assert b.stop() == 0, b.log_tail()
        _wait_members(c, 1)
        assert a.proc.poll() is None


def test_a_batch_with_a_block_over_the_max_stores_none_of_it_on_any_worker(nats, spawn):
    """Checked before any block is sent, against each block's owners' max block: no worker stores any of
    the batch (two owners, R=2, 3 MiB slabs: the other blocks would land on both)."""
    for i in range(2):
        spawn(nats_url=nats.url, node_id=f"node{i}", env={"KVPOOL_DRAM_SLAB_SIZE": str(3 << 20)})
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, node_id="client-node", timeout_s=3) as c:
        _wait_members(c, 2)
        keys = [f"t{i}" for i in range(8)]
        blocks = [_block(i) for i in range(8)]
        blocks[5] = bytes((3 << 20) + 1)
        with pytest.raises(BlockTooLarge) as big:
            c.batch_put(keys, blocks)
        assert big.value.key == b"t5" and big.value.limit == 3 << 20
        assert c.batch_exists(keys) == [False] * 8
        assert sum(s.cache.dram_blocks for s in c.stats().workers.values() if s.cache is not None) == 0


def _address(view) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def test_a_cluster_lease_is_in_place_on_the_same_node_and_a_copy_from_others(nats, spawn):
    """R=1: a key whose owner is on this node is leased in place (zero copy, in that worker's arena), the
    others copied; the leases end with the `with`."""
    spawn(nats_url=nats.url, node_id="here")
    spawn(nats_url=nats.url, node_id="there")
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="here", timeout_s=3) as c:
        _wait_members(c, 2)
        members = c.members()
        keys = [f"z{i}" for i in range(16)]
        c.batch_put(keys, [_block(i) for i in range(16)])
        owners = [rank(k.encode(), list(members))[0] for k in keys]
        assert {members[w].node_id for w in owners} == {"here", "there"}
        with c.batch_lease(keys + ["absent"]) as views:
            assert [None if v is None else bytes(v) for v in views] == [_block(i) for i in range(16)] + [None]
            arenas = {w: t.arena for w, t in c.backend.fanout.connected().items() if members[w].node_id == "here"}
            for view, w in zip(views, owners):
                inside = [a for a in arenas.values() if _address(a) <= _address(view) < _address(a) + len(a)]
                assert bool(inside) == (members[w].node_id == "here")
            held = {w: s.cache.dram_leases for w, s in c.stats().workers.items() if s.cache is not None}
            assert held == {w: owners.count(w) if members[w].node_id == "here" else 0 for w in members}
        leases = {w: s.cache.dram_leases for w, s in c.stats().workers.items() if s.cache is not None}
        assert leases == dict.fromkeys(members, 0)


def test_with_workers_of_two_max_blocks_each_block_is_held_to_its_owners(nats, spawn):
    """Workers with 3 and 4 MiB slabs: a 3.5 MiB block is taken where its owner is the larger one, and a
    batch with one owned by the smaller is refused whole, before anything is sent."""
    for i, slab in enumerate((3 << 20, 4 << 20)):
        spawn(nats_url=nats.url, node_id=f"node{i}", env={"KVPOOL_DRAM_SLAB_SIZE": str(slab)})
    with PoolClient(mode="cluster", nats_url=nats.url, node_id="client-node", timeout_s=3) as c:
        _wait_members(c, 2)
        members = c.members()
        cap = {w: info.max_block for w, info in members.items()}
        assert sorted(cap.values()) == [3 << 20, 4 << 20]
        keys = [f"h{i}" for i in range(40)]
        owner = {k: rank(k.encode(), list(members))[0] for k in keys}
        big = bytes((3 << 20) + (1 << 19))
        fits = next(k for k in keys if cap[owner[k]] == 4 << 20)
        refused = next(k for k in keys if cap[owner[k]] == 3 << 20)
        c.batch_put([fits, "small"], [big, b"s"])
        assert c.get(fits) == big
        with pytest.raises(BlockTooLarge) as e:
            c.batch_put(["other", refused], [b"o", big])
        assert e.value.key == refused.encode() and e.value.limit == 3 << 20
        assert c.batch_exists(["other", refused]) == [False, False]


def test_a_replicated_put_stages_device_tensors_once(nats, spawn, monkeypatch):
    """With R=2 every block goes to two owners: tensors that must be staged in host memory (CUDA ones:
    here CPU tensors taken for them) are staged once for the batch, not once per owner."""
    import torch

    from kvpool.core import buffers, cuda_staging

    staged: list[int] = []

    def host(n: int):
        staged.append(n)
        return torch.empty(n, dtype=torch.uint8)

    monkeypatch.setattr(buffers, "_on_cuda", buffers._is_torch)
    monkeypatch.setattr(cuda_staging, "_pinned", host)
    monkeypatch.setattr(cuda_staging, "_wait", lambda ts: None)
    for i in range(2):
        spawn(nats_url=nats.url, node_id=f"node{i}")
    with PoolClient(mode="cluster", nats_url=nats.url, replication=2, node_id="client-node", timeout_s=3) as c:
        _wait_members(c, 2)
        tensors = [torch.from_numpy(np.frombuffer(_block(i), dtype=np.uint8).copy()) for i in range(8)]
        c.batch_put([f"t{i}" for i in range(8)], tensors)
        assert staged == [8 * (32 << 10)]
        assert [c.get(f"t{i}") for i in range(8)] == [_block(i) for i in range(8)]
