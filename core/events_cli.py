"""`kvpool events`: follow the pool's block events from NATS; print them, or republish them in
vLLM's ZMQ KV-event format (`--zmq ENDPOINT`) for a cache-aware router."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from .errors import ConfigError, PoolUnavailable
from .events import EventBatch, EventFeed, key_to_json
from .events_zmq import HASHES, LAYOUTS, VllmFormat, ZmqSink
from .nats_creds import redacted_url
from .registry import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("events", help="follow the pool's block events (workers started with --events)")
    p.add_argument("--nats-url", default=os.environ.get("KVPOOL_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--replay", action="store_true", help="start with every event still retained (default: new ones)")
    p.add_argument("--zmq", metavar="ENDPOINT", help="republish as vLLM KV events on a PUB socket bound here, "
                   "e.g. tcp://127.0.0.1:5557 (needs kvpool[events])")
    p.add_argument("--layout", choices=LAYOUTS, default="map", help="events as tagged maps (current vLLM) or arrays")
    p.add_argument("--block-hash", choices=HASHES, default="bytes", help="32 bytes, or 64-bit ints (Dynamo)")
    p.add_argument("--block-tokens", type=int, default=16, help="the engine's tokens per block (16)")
    p.add_argument("--tier-moves", action="store_true", help="also moves between tiers (for media-aware routers)")
    p.add_argument("--topic", default="", help="ZMQ topic frame (default empty, as vLLM's)")
    p.set_defaults(func=run)
    return p


def _line(batch: EventBatch) -> str:
    """One batch as a JSON line, with its `node` and `boot`: a consumer tells a restarted worker (a new
    boot, seq from 0, its DRAM blocks gone) from one whose batches it missed (a gap in seq)."""
    return json.dumps({"worker": batch.worker, "node": batch.node, "boot": batch.boot, "seq": batch.seq,
                       "ts": batch.ts, "lost": batch.lost,
                       "events": [[e.kind, e.tier, e.reason, key_to_json(e.key)] for e in batch.events]})


def run(args: argparse.Namespace) -> int:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    sink = None
    try:
        if args.zmq:
            sink = ZmqSink(args.zmq, VllmFormat(args.layout, args.block_hash, args.block_tokens, args.tier_moves),
                           topic=args.topic)
        feed = EventFeed(args.nats_url, replay=args.replay)
    except (ConfigError, PoolUnavailable) as e:
        if sink is not None:
            sink.close()
        print(f"kvpool events: {e}", file=sys.stderr)
        return 2
    if sink is not None:
        print(f"kvpool events: {redacted_url(args.nats_url)} -> vLLM KV events on {sink.endpoint} ({args.layout}, "
              f"{args.block_hash} hashes)", file=sys.stderr, flush=True)
    try:
        while not done.is_set():
            batch = feed.next_batch(0.5)
            if batch is None:
                continue
            if sink is not None:
                sink(batch)
            else:
                print(_line(batch), flush=True)
    finally:
        feed.close()
        if sink is not None:
            sink.close()
    return 0
