"""The custom-consumer example: a prefix index rebuilt from a stream of block notifications."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvpool.core.keys import block_keys
from kvpool.streams import Consumer, Producer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "streams" / "prefix_index.py"


def _load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prefix_index", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefix_index_follows_commits_and_evictions(nats, make_stream):
    s = make_stream()
    chain = block_keys(list(range(64)), 16)  # 4 chained keys
    other = block_keys(list(range(100, 132)), 16)
    with Producer(s, nats.url) as p:
        p.publish({"op": "commit", "keys": chain})
        p.publish({"op": "commit", "keys": other})
        p.publish({"op": "evict", "keys": chain[2:]})
        p.publish({"op": "future-op", "keys": chain})
    index = _load().PrefixIndex()
    with Consumer(s, nats.url) as c:
        index.follow(c, idle_s=0.3)
    assert (index.match(chain), index.match(other), index.match(["x"] + chain), index.last_seq) == (2, 2, 0, 4)
    out = subprocess.run([sys.executable, str(EXAMPLE), "--nats-url", nats.url, "--stream", s, "--idle-s", "0.3"],
                         capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == {"blocks": 4, "last_seq": 4}
