"""Across processes, through a real worker: payloads by reference and the prefill/decode KV handoff."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvpool.streams import Consumer, HandoffReceiver, HandoffTimeout, stream_info

LAYERS, BLOCKS, BLOCK = 8, 2, 512 << 10


def _layer(request: str, layer: int) -> list[np.ndarray]:
    rng = np.random.default_rng([sum(request.encode()), layer])
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]


def _prefill(nats_url: str, stream: str, request: str, layers: int, end: bool) -> subprocess.Popen:
    """A child process that hands off `layers` layers of `request` and then ends it or hangs."""
    code = textwrap.dedent(f"""
        import sys, time
        import numpy as np
        from kvpool.core.client import PoolClient
        from kvpool.streams import Producer
        pool = PoolClient(mode="cluster", nats_url={nats_url!r})
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        # (a message a layer, as the test counts them: layers that come fast may otherwise go together)
        with Producer({stream!r}, {nats_url!r}, pool=pool, inline_max=64 << 10, hold_s=0) as p:
            p.publish(bytes(range(256)) * 8192)  # 2 MiB by reference
            for layer in range({layers}):
                rng = np.random.default_rng([{sum(request.encode())}, layer])
                blocks = [rng.integers(0, 256, {BLOCK}, dtype=np.uint8) for _ in range({BLOCKS})]
                p.publish_kv({request!r}, layer, [f"{request}/L{{layer}}/b{{i}}" for i in range({BLOCKS})], blocks)
            if {end}:
                p.end_request({request!r}, {layers})
            else:
                p.flush()  # every layer stored before the test kills us: publish_kv does not wait
                print("published", flush=True)
                time.sleep(600)
        pool.close()
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _reap(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()
    child.stdout.close()



def test_handoff_delivers_every_layer_identical_and_nats_never_carries_the_bulk(nats, make_stream, pool):
    s = make_stream()
    child = _prefill(nats.url, s, "req-1", LAYERS, end=True)
    try:
        got, during = [], {}
        kv = np.zeros((LAYERS, BLOCKS * BLOCK), dtype=np.uint8)  # the decode side's own KV memory
        with HandoffReceiver(s, nats.url, pool) as rx:
            for layer in rx.iter_layers("req-1", timeout=20, into=lambda layer, nbytes: kv[layer]):
                got.append(layer)
                during = stream_info(nats.url, s)
        assert child.wait(20) == 0
    finally:
        _reap(child)
    assert [layer for layer, _, _ in got] == list(range(LAYERS))
    for layer, keys, bufs in got:
        assert keys == [f"req-1/L{layer}/b{i}" for i in range(BLOCKS)]
        assert [bytes(b) for b in bufs] == [a.tobytes() for a in _layer("req-1", layer)]
        assert kv[layer].tobytes() == b"".join(a.tobytes() for a in _layer("req-1", layer))
    assert during["messages"] >= LAYERS + 1  # the payload and every layer, maybe the end
    assert during["bytes"] < 1024 * during["messages"]  # references only: ~10 MiB went through the pool
    info = stream_info(nats.url, s)
    assert (info["last_seq"], info["messages"]) == (LAYERS + 2, 1)  # the finished request was purged
    with Consumer(s, nats.url, pool=pool, topic="msg") as c:
        m = c.receive(5)
        assert (m.kind, bytes(m.data)) == ("ref", bytes(range(256)) * 8192)


def test_producer_killed_mid_request_is_a_handoff_timeout_not_a_hang(nats, make_stream, pool):
    s = make_stream()
    child = _prefill(nats.url, s, "req-2", 3, end=False)
    try:
        assert child.stdout.readline().strip() == "published"
        child.kill()
        child.wait()
        layers = []
        t = time.monotonic()
        with HandoffReceiver(s, nats.url, pool) as rx, pytest.raises(HandoffTimeout, match="after 3 layer") as err:
            for layer, _, bufs in rx.iter_layers("req-2", timeout=1.0):
                layers.append(layer)
                assert [bytes(b) for b in bufs] == [a.tobytes() for a in _layer("req-2", layer)]
        assert layers == [0, 1, 2]
        assert isinstance(err.value, TimeoutError)
        assert time.monotonic() - t < 5
    finally:
        _reap(child)
