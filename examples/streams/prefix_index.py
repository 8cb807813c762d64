"""A custom consumer: follow a stream of "block committed"/"block evicted" notifications and keep a
prefix index of what the pool holds, so a router can ask "how many leading blocks of this prompt are
cached?" without asking the pool.

    kvpool streams create blocks  # once (as the admin: `kvpool up` on this machine is)
    python examples/streams/prefix_index.py --nats-url nats://127.0.0.1:4222 --stream blocks

Notifications are JSON: {"op": "commit" | "evict", "keys": [chained block keys, in prompt order]}
(chained keys as made by `kvpool.core.block_keys`, so a prefix of keys names a prefix of tokens).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvpool.streams import Consumer, StreamNotFound


class PrefixIndex:
    """The set of committed block keys; `match` is the length of the longest cached prefix."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.last_seq = 0

    def apply(self, seq: int, event: dict[str, Any]) -> None:
        """Apply one notification (stream sequence `seq`); unknown ops are ignored (forward compatible)."""
        if event.get("op") == "commit":
            self.keys.update(event.get("keys", []))
        elif event.get("op") == "evict":
            self.keys.difference_update(event.get("keys", []))
        self.last_seq = seq

    def match(self, chain: Sequence[str]) -> int:
        """How many leading keys of `chain` are committed."""
        return next((i for i, k in enumerate(chain) if k not in self.keys), len(chain))

    def follow(self, consumer: Consumer, idle_s: float = 0.0) -> None:
        """Apply notifications as they arrive; return after `idle_s` quiet seconds (0 = never)."""
        while True:
            msg = consumer.receive(idle_s or 1.0)
            if msg is None:
                if idle_s:
                    return
                continue
            if msg.error is None and msg.is_json:  # forged or malformed messages arrive as 'invalid'
                self.apply(msg.seq, msg.json())
            msg.ack()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    ap.add_argument("--stream", default="blocks")
    ap.add_argument("--idle-s", type=float, default=0.0, help="exit after this many quiet seconds (0 = never)")
    args = ap.parse_args()
    index = PrefixIndex()
    try:
        with Consumer(args.stream, args.nats_url, start="all") as consumer:  # replay history, then follow
            index.follow(consumer, args.idle_s)
    except StreamNotFound:
        raise SystemExit(f"no stream {args.stream!r} at {args.nats_url}: make it first (`kvpool streams create "
                         f"{args.stream}`)") from None
    print(json.dumps({"blocks": len(index.keys), "last_seq": index.last_seq}))


if __name__ == "__main__":
    main()
