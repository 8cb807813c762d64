"""SGLang's HiCache pages stored through kvpool are announced under SGLang's own page hashes, on NATS
and to a ZMQ subscriber in vLLM's event format: what a cache-aware router that knows SGLang's hashes
needs to route on the pool's contents."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import msgspec

from kvpool.core.events_zmq import block_hash
from kvpool.core.nats_server import free_port

from sglang_pools import PAGE, create, dynamic_extra, host_pool

sys.path.insert(0, str(Path(__file__).parent.parent / "events"))
from evhelp import Subscriber, replay


def test_sglang_pages_appear_under_sglangs_page_hashes(nats, spawn) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    spawn(nats_url=nats.url, extra=["--events", "--events-zmq", endpoint])
    sub = Subscriber(endpoint)
    host = host_pool("page_first")
    backend = create(host, dynamic_extra(interface_v1=1, mode="cluster", nats_url=nats.url))
    try:
        probe = iter(range(1000))
        sub.until(lambda: bool(sub.frames),
                  kick=lambda: backend.batch_set_v1([f"{next(probe):064x}"], host.alloc(PAGE)))
        pages = [hashlib.sha256(f"page{i}".encode()).hexdigest() for i in range(6)]  # SGLang's 64-hex hashes
        assert backend.batch_set_v1(pages, host.alloc(6 * PAGE)) == [True] * 6
        wanted = {bytes.fromhex(p) for p in pages}
        index = replay(nats.url, set(), lambda ix: wanted <= {block_hash(k) for k in ix.keys()})
        parts = [k for k in index.keys() if block_hash(k) in wanted]
        assert len(parts) == 12  # MHA: a K and a V part per page, each naming its page's hash

        def stored() -> set[bytes]:
            return {h for f in sub.frames for e in msgspec.msgpack.decode(f[2])[1] if e["type"] == "BlockStored"
                    for h in e["block_hashes"]}

        sub.until(lambda: wanted <= stored())
    finally:
        backend.close()
        sub.close()
    assert {block_hash(k) for k in parts} == wanted
