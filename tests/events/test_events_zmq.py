"""A worker's block events as cache-aware routers read them: a ZMQ subscriber gets a BlockStored for
every block put through the pool and a BlockRemoved for every block evicted out of it, decoded with
the installed vLLM's own event classes (map layout, bytes hashes); the same events travel through NATS
and `kvpool events --zmq`, decoded with SGLang's own classes (map layout, int hashes: what sgl-router
reads) and with the types of vLLM's example subscriber (array layout, int hashes: older vLLM, Dynamo)."""
from __future__ import annotations

import signal
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from kvpool.core import PoolClient, block_keys
from kvpool.core.events_zmq import block_hash
from kvpool.core.nats_server import free_port

from evhelp import ArrayKVEventBatch, EngineDecode, Subscriber

BLOCK = 1 << 20


def _bridge(nats_url: str, endpoint: str, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "events", "--nats-url", nats_url,
                             "--zmq", endpoint, *extra], stderr=subprocess.PIPE)
    assert proc.stderr is not None
    line = proc.stderr.readline().decode()  # printed once it subscribed and bound
    if "vLLM KV events on" not in line:
        proc.kill()
        proc.wait()
        proc.stderr.close()
        raise AssertionError(f"kvpool events did not start: {line}")
    return proc


@pytest.mark.timeout(600)  # the first run on a machine builds vLLM's environment (about 2 minutes)
def test_stores_and_evictions_reach_zmq_subscribers(nats, spawn) -> None:
    direct, bridged, sgl = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    spawn(nats_url=nats.url, dram_bytes="64MiB", extra=["--events", "--events-zmq", direct])
    bridges: list[subprocess.Popen[bytes]] = []
    subs = [Subscriber(direct), Subscriber(bridged), Subscriber(sgl)]
    try:
        bridges.append(_bridge(nats.url, bridged, "--layout", "array", "--block-hash", "int", "--block-tokens", "32"))
        bridges.append(_bridge(nats.url, sgl, "--block-hash", "int"))
        with PoolClient(mode="cluster", nats_url=nats.url) as pool:
            assert pool.wait_for_members(lambda m: len(m) == 1, 15)
            probes = iter(range(1000))
            for sub in subs:  # a PUB drops what it sends before a subscription reaches it
                sub.until(lambda s=sub: bool(s.frames), kick=lambda: pool.put(f"probe/{next(probes)}", b"p"))
            # keys as kvpool's vLLM connector makes them: vllm/<sha256 of the token chain>
            keys = ["vllm/" + k for k in block_keys(list(range(16 * 150)), 16, "vllm|tiny|bf16|bs16|tp0of1|cpu")]
            assert len(keys) == 150
            blocks = [np.full(BLOCK, i % 251, dtype=np.uint8) for i in range(len(keys))]
            for i in range(0, len(keys), 10):  # 150 MiB through a 64 MiB arena: most are evicted
                pool.batch_put(keys[i:i + 10], blocks[i:i + 10])
            present = pool.batch_exists(keys)
            evicted = {bytes.fromhex(k[5:]) for k, p in zip(keys, present) if not p}
            evictions = pool.stats().total.evictions
        assert len(evicted) > 60 and sum(present) > 10
        wanted = {bytes.fromhex(k[5:]) for k in keys}
        assert all(block_hash(k.encode()) == bytes.fromhex(k[5:]) for k in keys)  # the engine's own hash

        # the worker's own socket: everything arrives, and vLLM's own KVEventBatch decodes it
        def direct_hashes(kind: str) -> list[bytes]:
            return [h for f in subs[0].frames for e in msgspec.msgpack.decode(f[2])[1] if e["type"] == kind
                    for h in e["block_hashes"]]

        subs[0].until(lambda: wanted <= set(direct_hashes("BlockStored"))
                      and set(direct_hashes("BlockRemoved")) & wanted == evicted)
        vllm = EngineDecode("vllm", "vllm_decode.py", [f[2] for f in subs[0].frames])
        as_int = {int.from_bytes(h, "big") & ((1 << 64) - 1): h for h in wanted}

        def int_hashes(kind: str) -> list[int]:
            return [h for f in subs[2].frames for e in msgspec.msgpack.decode(f[2])[1] if e["type"] == kind
                    for h in e["block_hashes"]]

        subs[2].until(lambda: set(as_int) <= set(int_hashes("BlockStored"))
                      and {as_int[h] for h in int_hashes("BlockRemoved") if h in as_int} == evicted)
        sglang = EngineDecode("sglang", "sglang_decode.py", [f[2] for f in subs[2].frames])
        events = vllm.result()
        stored = {bytes.fromhex(h) for e in events if e[0] == "BlockStored" for h in e[1]}
        removed = [bytes.fromhex(h) for e in events if e[0] == "BlockRemoved" for h in e[1]]
        assert wanted <= stored
        assert {e[2] for e in events if e[0] == "BlockStored"} == {"CPU"}  # DRAM, in vLLM's media
        assert set(removed) & wanted == evicted and len(removed) == evictions
        assert {e[3] for e in events if e[0] == "BlockStored"} == {16}
        assert [f[1] for f in subs[0].frames] == list(range(subs[0].frames[0][1], subs[0].frames[-1][1] + 1))

        # through NATS and `kvpool events`: SGLang's own classes (64-bit hashes)
        sg = sglang.result()
        sg_stored = {h for e in sg if e[0] == "BlockStored" for h in e[1]}
        sg_removed = [h for e in sg if e[0] == "BlockRemoved" for h in e[1]]
        assert set(as_int) <= sg_stored and {as_int[h] for h in sg_removed if h in as_int} == evicted
        assert len(sg_removed) == evictions and {e[2] for e in sg if e[0] == "BlockStored"} == {"CPU"}

        # older vLLM's array layout, Dynamo's 64-bit hashes
        dec = msgspec.msgpack.Decoder(ArrayKVEventBatch)

        def bridged_events() -> tuple[set[int], list[int]]:
            got_s: set[int] = set()
            got_r: list[int] = []
            for _, _, payload in subs[1].frames:
                batch = dec.decode(payload)
                assert batch.data_parallel_rank == 0
                for e in batch.events:
                    if type(e).__name__ == "ArrayBlockStored":
                        assert e.block_size == 32 and e.medium == "CPU" and e.token_ids == []
                        got_s.update(e.block_hashes)
                    elif type(e).__name__ == "ArrayBlockRemoved":
                        got_r.extend(e.block_hashes)
            return got_s, got_r

        subs[1].until(lambda: set(as_int) <= bridged_events()[0]
                      and {as_int[h] for h in bridged_events()[1] if h in as_int} == evicted)
        assert len(bridged_events()[1]) == evictions
    finally:
        for sub in subs:
            sub.close()
        for bridge in bridges:
            bridge.send_signal(signal.SIGTERM)
            rc = bridge.wait(10)
            bridge.stderr.close()  # type: ignore[union-attr]
            assert rc == 0
