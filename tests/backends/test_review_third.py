"""Review of the fixes ddbf798 (pointer adapters check /proc/self/maps), 789e786 (streams) and d7a085c
(key identity): cases the fixes still get wrong. Each test names the bug it shows."""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.core import PoolClient
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.streams import HandoffError, HandoffReceiver, HandoffTimeout, Producer, StreamConfig, create_stream

_names = itertools.count()
BLOCK = 64 << 10


@pytest.fixture
def make_stream(nats: NatsServer) -> Callable[..., str]:
    def _make(**cfg: object) -> str:
        name = f"rv{next(_names)}"
        create_stream(nats.url, name, StreamConfig(**cfg))  # type: ignore[arg-type]
        return name
    return _make


@pytest.fixture
def pool(spawn: Callable[..., WorkerProcess], nats: NatsServer):
    spawn(nats_url=nats.url)
    with PoolClient(mode="cluster", nats_url=nats.url) as c:
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        yield c


# Bug: a request whose end came LIVE is purged without bound when the id's next request is already stored
# (stored_last is not the end for 1 s, then purge_stream(subject) with no seq): the next request is lost.
# And (a third review): that purge waited 1 s before it looked for the end, so a receiver reading the id again
# with a timeout under a second gave up on a request stored whole.
@pytest.mark.parametrize("timeout", [5.0, 0.8])
def test_purge_of_a_live_end_keeps_the_next_request_of_the_same_id(nats, make_stream, pool, timeout):
    s = make_stream()
    old = [np.full(BLOCK, 1 + layer, dtype=np.uint8) for layer in range(2)]
    new = [np.full(BLOCK, 7 + layer, dtype=np.uint8) for layer in range(2)]

    def produce() -> None:
        time.sleep(1.0)  # the receiver is subscribed: the first request comes live
        with Producer(s, nats.url, pool=pool) as p:
            for layer in range(2):
                p.publish_kv("rid", layer, [f"rid-old/L{layer}"], [old[layer]])
            p.end_request("rid", 2)
            for layer in range(2):  # the prefill side's next request of this id, right after
                p.publish_kv("rid", layer, [f"rid-new/L{layer}"], [new[layer]])
            p.end_request("rid", 2)

    t = threading.Thread(target=produce)
    with HandoffReceiver(s, nats.url, pool) as rx:
        t.start()
        first = []
        for layer, _keys, _bufs in rx.iter_layers("rid", timeout=10):
            first.append(layer)
            if layer == 1:
                t.join(20)  # the second request is stored before the first one's end is taken (live)
        assert first == [0, 1]
        try:
            got = [(layer, keys, [bytes(b) for b in bufs])
                   for layer, keys, bufs in rx.iter_layers("rid", timeout=timeout)]
        except (HandoffError, HandoffTimeout) as e:
            pytest.fail(f"the second request of the id was purged with the first: {e!r}")
    assert got == [(layer, [f"rid-new/L{layer}"], [new[layer].tobytes()]) for layer in range(2)]


def _tenant_store(spawn: Callable[..., WorkerProcess], tenant: str):
    from kvpool.backends.mooncake_compat import MooncakeDistributedStore

    worker = spawn()
    s = MooncakeDistributedStore()
    return s, s.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.unix_path, tenant_id=tenant)


# Bug: the tenant id is percent-quoted with urllib.parse.quote (strict UTF-8): a tenant id holding a lone
# surrogate makes setup() raise UnicodeEncodeError into the engine instead of answering a status.
def test_mooncake_setup_with_a_surrogate_tenant_is_a_status_not_an_exception(spawn):
    try:
        s, rc = _tenant_store(spawn, "team-\udcff")
    except UnicodeError as e:
        pytest.fail(f"setup() raised {e!r}; Mooncake's setup answers a status")
    try:
        assert isinstance(rc, int)
    finally:
        s.close()


# Bug: percent-quoting a tenant id triples each non-ASCII byte ("%E7%A7%9F"): a tenant id of 60 CJK
# characters (180 bytes, keys well under 511 before the fix) now makes a prefix over 511 bytes, and every
# key of that tenant, long-key digest included (it keeps the prefix), is refused: every put fails.
def test_mooncake_tenant_with_a_non_ascii_id_still_stores_its_objects(spawn):
    s, rc = _tenant_store(spawn, "研发" * 30)
    try:
        assert rc == 0
        assert s.put("k", b"of a CJK tenant") == 0
        assert s.get("k") == b"of a CJK tenant"
    finally:
        s.close()


@pytest.fixture
def small_pool(spawn: Callable[..., WorkerProcess], nats: NatsServer):
    """A pool of one 32 MiB worker without SSD: an evicted block is gone."""
    spawn(nats_url=nats.url, dram_bytes="32MiB")
    with PoolClient(mode="cluster", nats_url=nats.url) as c:
        assert c.wait_for_members(lambda m: len(m) == 1, 15)
        yield c


# Bug: a layer whose announcement is over the server's max_payload is now refused by Wire.publish inside
# Announcer.send (StreamRefused, synchronously), which skips the refusal path that unpins (`_on_refused`):
# the layer's blocks, put pinned, stay pinned for pin_ttl_s although nothing can ever read them.
def test_a_layer_refused_for_max_payload_leaves_its_blocks_unpinned(nats, make_stream, small_pool):
    from kvpool.streams import StreamRefused

    s = make_stream()
    n = 2200  # keys of 500 bytes: an announcement of about 1.1 MB, over nats-server's 1 MiB max_payload
    keys = [f"{i:06d}-" + "k" * 493 for i in range(n)]
    blocks = [np.full(4096, i % 251, dtype=np.uint8) for i in range(n)]
    with Producer(s, nats.url, pool=small_pool, pin_ttl_s=600) as p:
        with pytest.raises(StreamRefused):
            p.publish_kv("big", 0, keys, blocks)
        deadline = time.monotonic() + 10  # (a pin or unpin is not waited for by the call)
        while (pins := small_pool.stats().total.pins) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert pins == 0, f"{pins} blocks of a layer that was never announced are still pinned"


# Bug: iter_layers of a request id whose earlier run's purge is under way first waits for that purge,
# up to the link's timeout_s + 2 s, outside its own `timeout`: with NATS gone, a receiver reading the id
# again (an engine's retry) blocks about 6 s, not "t + LOOK_S" as handoff.LOOK_S promises.
def test_reading_an_id_again_with_nats_gone_gives_up_near_its_own_timeout(nats, make_stream, pool):
    from kvpool.streams import StreamUnavailable, handoff

    s = make_stream()
    with Producer(s, nats.url, pool=pool) as p:
        for layer in range(2):
            p.publish_kv("gone", layer, [f"gone/L{layer}"], [np.full(BLOCK, layer, dtype=np.uint8)])
        p.end_request("gone", 2)
    rx = HandoffReceiver(s, nats.url, pool)
    try:
        for layer, _, _ in rx.iter_layers("gone", timeout=10):
            if layer == 1:
                nats.stop()  # the end is in hand: its purge starts with NATS gone
        t = time.monotonic()
        with pytest.raises((TimeoutError, StreamUnavailable, HandoffTimeout)):
            next(iter(rx.iter_layers("gone", timeout=1.0)))
        waited = time.monotonic() - t
    finally:
        rx.close()
    assert waited < 1.0 + 3 * handoff.LOOK_S, f"gave up after {waited:.2f} s"


# Bug: `kvpool streams pub NAME DATA` encodes DATA with strict UTF-8 (`args.data.encode()`): an argument
# that is not UTF-8 (Python's argv holds it with surrogateescape) is refused as "--json: the data is not
# JSON" although --json was not given, instead of publishing its bytes (os.fsencode) as stdin's are.
def test_cli_pub_publishes_a_non_utf8_argument_as_its_bytes(nats, make_stream, capsys):
    from kvpool.core.cli import main as kvpool_main
    from kvpool.streams import Consumer

    s = make_stream()
    code = kvpool_main(["streams", "--nats-url", nats.url, "pub", s, "caf\udce9"])  # argv of b"caf\xe9"
    err = capsys.readouterr().err
    assert code == 0, err
    with Consumer(s, nats.url) as c:
        assert c.receive(5).data == b"caf\xe9"
