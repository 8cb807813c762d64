"""Run with vLLM's Python: decode ZMQ payloads (hex, one per stdin line) with vLLM's own
`vllm.distributed.kv_events.KVEventBatch` and print what they hold as one JSON list."""
from __future__ import annotations

import json
import sys

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for line in sys.stdin:
    batch = decoder.decode(bytes.fromhex(line.strip()))
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append(["BlockStored", [h.hex() for h in e.block_hashes], e.medium, e.block_size, e.token_ids,
                        e.parent_block_hash])
        elif isinstance(e, BlockRemoved):
            out.append(["BlockRemoved", [h.hex() for h in e.block_hashes], e.medium])
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append(["AllBlocksCleared"])
    out.append(["batch", batch.ts, batch.data_parallel_rank])
print(json.dumps(out))
