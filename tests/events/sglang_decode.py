"""Run with SGLang's Python: decode ZMQ payloads (hex, one per stdin line) with SGLang's own
`sglang.srt.disaggregation.kv_events.KVEventBatch` (what sgl-router reads) and print them as JSON."""
from __future__ import annotations

import json
import sys

import msgspec
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for line in sys.stdin:
    batch = decoder.decode(bytes.fromhex(line.strip()))
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append(["BlockStored", e.block_hashes, e.medium, e.block_size])
        elif isinstance(e, BlockRemoved):
            out.append(["BlockRemoved", e.block_hashes, e.medium])
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append(["AllBlocksCleared"])
print(json.dumps(out))
