"""Prefill -> decode KV handoff, layer by layer: the two sides of a disaggregated deployment.

    kvpool streams --nats-url nats://10.0.0.1:4222 create kv-handoff --max-age-s 600  # once, as admin
    python examples/streams/pd_handoff.py decode  --nats-url nats://10.0.0.1:4222 --stream kv-handoff --request r1
    python examples/streams/pd_handoff.py prefill --nats-url nats://10.0.0.1:4222 --stream kv-handoff --request r1

The prefill side's pool places locally (`placement="local"`): each layer goes into its own node's worker
through shared memory, and a decode instance on another node reads it from there over one TCP
connection (on the same node, it copies it straight out of the worker's shared memory). The decode side
waits for the request's layers and copies each into its own KV buffer as soon as it is published, every
block checked against the checksum its announcement carries; it prints one JSON line: the layers in
order, whether every byte is the prefill's, and how its blocks came (`in_place`: from shared memory on
the prefill's node; `from_pool`: over the network).

On a node other than the one that ran `kvpool up`, each side needs what any client there needs (README,
"NATS access"): the client's NATS credentials (`KVPOOL_NATS_CREDS=/path/client.json`) and the pool token
(`KVPOOL_TOKEN_FILE`), and workers and NATS listening on addresses that node can reach (`kvpool up`
listens on 127.0.0.1). `--max-age-s` drops the messages of a request whose decode side never came.

The KV here is synthetic (float16, seeded by the request id), so that the decode side can tell the bytes
are right; an engine would pass its own per-layer tensors (numpy or torch, CPU or CUDA).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from kvpool.core import PoolClient
from kvpool.streams import HandoffReceiver, Producer

LAYERS, TOKENS, HEADS, DIM = 8, 256, 8, 64
"""The shape of the example's KV: per layer, K and V of TOKENS x HEADS x DIM float16 (512 KiB)."""


def layer_kv(request: str, layer: int) -> np.ndarray:
    """Layer `layer`'s K and V for `request`: what a prefill would have computed."""
    rng = np.random.default_rng([sum(request.encode()), layer])
    return rng.standard_normal((2, TOKENS, HEADS, DIM), dtype=np.float32).astype(np.float16)


def prefill(args: argparse.Namespace) -> dict[str, object]:
    with PoolClient(mode="cluster", nats_url=args.nats_url, placement="local") as pool, \
            Producer(args.stream, args.nats_url, pool=pool) as producer:
        if not pool.wait_for_members(lambda m: len(m) > 0, args.timeout):
            raise SystemExit(f"no kvpool worker joined the cluster at {args.nats_url} within {args.timeout} s")
        for layer in range(LAYERS):
            producer.publish_kv(args.request, layer, [f"{args.request}/L{layer}"], [layer_kv(args.request, layer)])
        producer.end_request(args.request, LAYERS)  # waits until every layer is committed and announced
    return {"request": args.request, "layers": LAYERS}


def decode(args: argparse.Namespace) -> dict[str, object]:
    kv = np.zeros((LAYERS, 2, TOKENS, HEADS, DIM), dtype=np.float16)  # the decode engine's KV memory

    def into(layer: int, nbytes: int) -> np.ndarray:
        return kv[layer].reshape(-1).view(np.uint8)[:nbytes]

    with PoolClient(mode="cluster", nats_url=args.nats_url) as pool, \
            HandoffReceiver(args.stream, args.nats_url, pool) as rx:
        layers = [layer for layer, _, _ in rx.iter_layers(args.request, timeout=args.timeout, into=into)]
    exact = all(np.array_equal(kv[i], layer_kv(args.request, i)) for i in range(LAYERS))
    return {"layers": layers, "exact": exact, "in_place": rx.counts["in_place"], "from_pool": rx.counts["from_pool"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--nats-url", required=True)
    p.add_argument("--stream", required=True)
    p.add_argument("--request", required=True)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a worker, or for each layer")
    args = p.parse_args(argv)
    print(json.dumps(prefill(args) if args.role == "prefill" else decode(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
