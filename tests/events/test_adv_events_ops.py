"""Adversarial checks of block events and operations tooling (see the report for each bug)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvpool.core import PoolClient, TieredCache
from kvpool.core.errors import ProtocolError
from kvpool.core.events import BlockEvent, EventBatch, EventFeed, EventIndex, EventQueue
from kvpool.core.events_zmq import VllmFormat, block_hash, vllm_events
from kvpool.core.procs import WorkerProcess


def _replay_all(url: str, quiet_s: float = 2.0, timeout_s: float = 20.0,
                batches: list[EventBatch] | None = None) -> EventIndex:
    """Every retained batch applied, until none arrives for `quiet_s` (kept in `batches` if given)."""
    index = EventIndex()
    deadline = time.monotonic() + timeout_s
    with EventFeed(url, replay=True) as feed:
        while time.monotonic() < deadline:
            batch = feed.next_batch(quiet_s)
            if batch is None:
                break
            index.apply(batch)
            if batches is not None:
                batches.append(batch)
    return index


# Bug: a worker restarted on its SSD tier (same worker id) after kill -9 never retracts what its last
# boot announced in DRAM: the replayed EventIndex says it holds blocks the pool lost.
def test_a_restarted_worker_retracts_what_its_last_boot_held(nats, tmp_path) -> None:
    keys = [f"boot/{i}" for i in range(8)]
    first = WorkerProcess(tmp_path / "w", nats_url=nats.url, ssd=True, dram_bytes="64MiB", extra=["--events"])
    port = first.port
    try:
        first.wait_ready()
        with PoolClient(mode="cluster", nats_url=nats.url) as pool:
            assert pool.wait_for_members(lambda m: len(m) == 1, 15)
            pool.batch_put(keys, [np.full(4096, i, dtype=np.uint8) for i in range(len(keys))])
        time.sleep(0.5)  # the batch is published (every 50 ms)
    finally:
        first.kill()  # kill -9: its DRAM is gone
    second = WorkerProcess(tmp_path / "w", nats_url=nats.url, ssd=True, dram_bytes="64MiB", extra=["--events"],
                            port=port)
    try:
        second.wait_ready()
        with PoolClient(mode="cluster", nats_url=nats.url) as pool:
            assert pool.wait_for_members(lambda m: len(m) >= 1, 15)
            held = pool.batch_exists(keys)
            live = set(pool.members())
        assert not any(held)
        index = _replay_all(nats.url)
        assert {k.encode() for k in keys} <= index.seen
        stale = sorted(k for k in index.keys() if k.startswith(b"boot/"))
        assert all(index.workers(k) <= live for k in stale)  # the same worker id, up again
        assert stale == [], f"the index says {len(stale)} lost blocks are still held: {stale[:3]}"
    finally:
        second.stop()


# Bug: a worker without an SSD tier that stops cleanly (SIGTERM) drops every block, but publishes
# nothing that says so: a replayed EventIndex keeps routing its keys to a worker that is gone.
def test_a_stopped_worker_without_ssd_retracts_its_blocks(nats, tmp_path) -> None:
    keys = [f"gone/{i}" for i in range(8)]
    w = WorkerProcess(tmp_path / "w", nats_url=nats.url, dram_bytes="64MiB", extra=["--events"])
    try:
        w.wait_ready()
        with PoolClient(mode="cluster", nats_url=nats.url) as pool:
            assert pool.wait_for_members(lambda m: len(m) == 1, 15)
            pool.batch_put(keys, [np.full(4096, i, dtype=np.uint8) for i in range(len(keys))])
    finally:
        assert w.stop() == 0  # SIGTERM: a clean stop; its DRAM tier, the only one, goes with it
    index = _replay_all(nats.url)
    assert {k.encode() for k in keys} <= index.seen
    stale = sorted(k for k in index.keys() if k.startswith(b"gone/"))
    assert stale == [], f"the index says a stopped worker still holds {len(stale)} blocks: {stale[:3]}"


def _media_view(q: EventQueue, fmt: VllmFormat) -> set[tuple[bytes, str]]:
    """(block hash, medium) pairs a media-aware router holds after the events queued so far."""
    view: set[tuple[bytes, str]] = set()
    batch = EventBatch("w", "n", "b", 0, 0.0, q.lost, q.take(1 << 20, 1 << 40))
    for e in vllm_events(batch, fmt):
        if e["type"] == "BlockStored":
            view |= {(h, e["medium"]) for h in e["block_hashes"]}
        elif e["type"] == "BlockRemoved":
            view -= {(h, e["medium"]) for h in e["block_hashes"]}
        else:
            view.clear()
    return view


# Bug: with --tier-moves, overwriting a block that had an SSD copy drops that copy silently: a
# media-aware router keeps a STORAGE entry for a block the pool no longer holds at all.
def test_tier_moves_retract_the_ssd_copy_an_overwrite_replaced(tmp_path) -> None:
    cache = TieredCache(dram_bytes=32 << 20, dram_slab_size=1 << 20, prefault=False,
                        ssd_path=str(tmp_path / "ssd"), ssd_sync=False)
    try:
        q = EventQueue()
        cache.add_listener(q)
        key = "vllm/" + "ab" * 32
        cache.put(key, b"old" * 1000)
        cache.flush()  # now in DRAM and on SSD
        cache.put(key, b"new" * 1000)  # new bytes: the SSD copy of the old ones is gone
        cache.remove(key)
        assert not cache.exists(key)
        view = _media_view(q, VllmFormat(tier_moves=True))
        h = block_hash(key.encode())
        assert view == set(), f"router still believes {sorted(m for _, m in view)} hold {h.hex()[:8]}"
    finally:
        cache.close()



# Bug: `kvpool events --zmq` maps each worker's batches alone onto one pool-wide feed: when a put moves a
# key to a worker that joined (stored there) and the old owner then drops its superseded copy (removed
# there), the router gets BlockStored then BlockRemoved and forgets a block the pool holds. Seen with
# two real workers: after the second joined and 40 keys were put again, the bridge's view kept 19 of 40.
def test_bridge_keeps_a_block_another_worker_still_holds() -> None:
    key = ("vllm/" + "cd" * 32).encode()
    joined = EventBatch("b", "n", "b0", 0, 1.0, 0, [BlockEvent("stored", "dram", "", key)])
    old_owner = EventBatch("a", "n", "a0", 1, 1.001, 0, [BlockEvent("removed", "dram", "remove", key)])
    index = EventIndex()
    view: set[bytes] = set()
    for batch in (joined, old_owner):  # the order they are made in: the put, then its supersede
        index.apply(batch)
        for e in vllm_events(batch, VllmFormat()):  # what `kvpool events --zmq` sends for the batch
            if e["type"] == "BlockStored":
                view |= set(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                view -= set(e["block_hashes"])
    assert index.workers(key) == {"b"}
    assert view == {block_hash(key)}, "a router fed by the bridge forgot a block worker b holds"


# Bug: EventBatch.decode promises ProtocolError for a malformed batch, but a huge number or deep nesting
# escapes as OverflowError / RecursionError (EventFeed then logs it and does not count it as malformed).
@pytest.mark.parametrize("data", [b'{"worker":"w","seq":1e400,"ts":0,"events":[]}',
                                  b'{"worker":"w","seq":1,"ts":0,"lost":1e400,"events":[]}',
                                  b"[" * 100_000 + b"]" * 100_000])
def test_decode_of_a_malformed_batch_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        EventBatch.decode(data)



# Bug: the DaemonSet runs the worker as uid 1000 but its state and socket folders are hostPath
# DirectoryOrCreate volumes, which kubelet creates root-owned, mode 0755: on a fresh node the worker
# cannot create its socket (`ListenError: ... Permission denied`, reproduced with setpriv) nor its state.
def test_daemonset_worker_can_write_its_host_folders() -> None:
    import yaml

    docs = [d for d in yaml.safe_load_all((Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" /
                                           "kvpool-worker.yaml").read_text()) if d]
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    uid = (worker.get("securityContext") or {}).get("runAsUser",
                                                    (pod.get("securityContext") or {}).get("runAsUser", 0))
    created = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]
               if v.get("hostPath", {}).get("type") == "DirectoryOrCreate"}
    written = [m["name"] for m in worker["volumeMounts"] if m["name"] in created and not m.get("readOnly")]
    prepared = {m["name"] for c in pod.get("initContainers", [])
                if (c.get("securityContext") or {}).get("runAsUser", 0) == 0 for m in c.get("volumeMounts", [])}
    unwritable = [created[n] for n in written if uid != 0 and n not in prepared]
    assert not unwritable, (f"uid {uid} cannot write {unwritable}: kubelet creates them root-owned 0755 and "
                            "nothing in the pod hands them to the worker's user")



# Bug: README said a BlockStored's hash "is the engine's own" for the vLLM connector's `vllm/<sha256>` keys,
# but those are kvpool's own chain hashes (`block_keys`), never vLLM's block hashes (`hash_block_tokens`).
# The keys stay as they are (changing them would orphan every stored block); the README and `events_zmq`
# now say the hash is kvpool's own chain hash, and this checks that documented mapping.
def test_pool_block_hashes_are_kvpools_chain_hashes_for_connector_keys() -> None:
    from kvpool.backends._vllm_plan import pool_keys, request_namespace
    from kvpool.core import block_keys

    ns = request_namespace("vllm|tiny|bf16|bs16|tp0of1|cpu")
    tokens = list(range(64))
    pool = [block_hash(k.encode()) for k in pool_keys(tokens, 16, ns)]
    assert len(pool) == 4
    assert pool == [bytes.fromhex(k) for k in block_keys(tokens, 16, ns)]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "not vLLM's block hash" in readme and "is the engine's own" not in readme



# Bug: `kvpool events` prints batches without their `boot` (nor `node`): a consumer of the JSON lines
# cannot tell a worker that restarted (seq back to 0, its DRAM blocks gone) from one it lost track of.
def test_kvpool_events_lines_carry_the_batch_boot(nats, spawn) -> None:
    import json
    import signal
    import subprocess
    import sys

    spawn(nats_url=nats.url, extra=["--events"])
    with PoolClient(mode="cluster", nats_url=nats.url) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        pool.put("line/1", b"x")
    tail = subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "events", "--nats-url", nats.url, "--replay"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert tail.stdout is not None
        line = json.loads(tail.stdout.readline())
    finally:
        tail.send_signal(signal.SIGTERM)
        tail.wait(10)
        tail.stdout.close()  # type: ignore[union-attr]
    assert "boot" in line and "node" in line, f"fields printed: {sorted(line)}"


# Bug: during a NATS outage the events past nats-py's 2 MiB reconnect buffer are dropped: not retried,
# not counted in `lost`, never re-announced: a replayed index misses blocks the pool holds, and
# nothing but a gap in `seq` (which EventIndex ignores) says so.
def test_events_dropped_in_a_nats_outage_are_counted_or_resent(nats, spawn) -> None:
    spawn(nats_url=nats.url, dram_bytes="128MiB", extra=["--events"])
    pad = "p" * 400
    keys = [f"out/{i:05d}/{pad}" for i in range(8000)]  # ~3.5 MiB of events
    with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=3) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        pool.put("out/first", b"f")
        time.sleep(0.5)
        nats.stop()
        for i in range(0, len(keys), 500):
            pool.batch_put(keys[i:i + 500], [b"v"] * 500)
        time.sleep(1.0)
        nats.start()
        time.sleep(3.0)
        pool.put("out/last", b"l")
        assert all(pool.batch_exists(keys))
        batches: list[EventBatch] = []
        index = _replay_all(nats.url, batches=batches)
    assert b"out/last" in index.seen
    missing = sum(1 for k in keys if k.encode() not in index.keys())
    seqs = [b.seq for b in batches]
    gaps = len(set(range(max(seqs) + 1)) - set(seqs))
    lost = batches[-1].lost
    assert lost >= missing, f"{missing} held blocks never announced ({gaps} batches missing), yet lost = {lost}"
