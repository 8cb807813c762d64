"""Both sides of a prefill->decode handoff, one per lab host:

    handoff.py prefill OPTS   publishes LAYERS layers of one request (blocks through the pool); prints
                              {"node": its node id}
    handoff.py decode OPTS    receives them and prints {"layers": [...], "exact": bool, "holders":
                              {node id: how many of the request's blocks that node's worker holds}}

OPTS is JSON: {"nats_url", "token", "stream", "request"}, and "placement" (the prefill's, default hash).
"""
from __future__ import annotations

import json
import sys

import numpy as np

from kvpool.core import PoolClient
from kvpool.core.config import default_node_id
from kvpool.streams import HandoffReceiver, Producer

LAYERS, BLOCKS, BLOCK = 6, 2, 256 << 10


def layer_blocks(request: str, layer: int) -> list[np.ndarray]:
    rng = np.random.default_rng([sum(request.encode()), layer])
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]


def main() -> int:
    role, opts = sys.argv[1], json.loads(sys.argv[2])
    request = opts["request"]
    placement = opts.get("placement", "hash") if role == "prefill" else "hash"
    with PoolClient(mode="cluster", nats_url=opts["nats_url"], token=opts["token"], placement=placement) as pool:
        if not pool.wait_for_members(lambda m: len(m) >= 3, 30):
            raise SystemExit(f"{role}: the cluster's three workers were not all members within 30 s")
        if role == "prefill":
            with Producer(opts["stream"], opts["nats_url"], pool=pool) as p:
                for layer in range(LAYERS):
                    p.publish_kv(request, layer, [f"{request}/L{layer}/b{i}" for i in range(BLOCKS)],
                                 layer_blocks(request, layer))
                p.end_request(request, LAYERS)
            print(json.dumps({"node": default_node_id()}), flush=True)
            return 0
        layers, exact = [], True
        with HandoffReceiver(opts["stream"], opts["nats_url"], pool) as rx:
            for layer, _, bufs in rx.iter_layers(request, timeout=30):
                layers.append(layer)
                exact &= [bytes(b) for b in bufs] == [a.tobytes() for a in layer_blocks(request, layer)]
        keys = [f"{request}/L{layer}/b{i}" for layer in range(LAYERS) for i in range(BLOCKS)]
        holders = {}
        for info in pool.members().values():  # each worker asked alone, whatever placement says
            with PoolClient(mode="local", worker=info.tcp, token=opts["token"]) as one:
                holders[info.node_id] = sum(one.batch_exists(keys))
        print(json.dumps({"layers": layers, "exact": exact, "holders": holders}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
