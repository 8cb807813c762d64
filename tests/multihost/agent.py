"""A pool client on one lab host, driven by JSON lines on stdin (one command, one reply line).

Every block's bytes are a function of (key, version): a reply says, per key, the version read (-1 for
a miss) or "wrong" when the bytes are no version of that key at all; the test judges staleness.
Each reply carries the call's duration, so deadlines are checked from outside the pool.

    {"op": "put", "keys": [...], "version": 3, "size": 65536}   -> {"ok": true, "s": 0.01}
    {"op": "put_each", ...as put...}                            -> {"acked": [true, false, ...], "s": ...}
    {"op": "get", "keys": [...], "size": 65536}                  -> {"versions": [3, -1, ...], "s": ...}
    {"op": "remove", "keys": [...]}                               -> {"removed": [...], "s": ...}
    {"op": "members"}                                             -> {"members": {worker id: "host:port"}}
"""
from __future__ import annotations

import json
import struct
import sys
import time
from typing import Any

import numpy as np
import xxhash

from kvpool.core import KVPoolError, PoolClient, PoolUnavailable

_HEAD = struct.Struct("<QQ")  # version, xxh64(key)


def block(key: str, version: int, size: int) -> bytes:
    seed = xxhash.xxh64_intdigest(f"{key}@{version}".encode())
    body = np.random.default_rng(seed).integers(0, 256, size - _HEAD.size, dtype=np.uint8).tobytes()
    return _HEAD.pack(version, xxhash.xxh64_intdigest(key.encode())) + body


def version_of(key: str, data: bytes, size: int) -> int | str:
    if len(data) != size:
        return "wrong"
    version, tag = _HEAD.unpack_from(data)
    if tag != xxhash.xxh64_intdigest(key.encode()) or data != block(key, version, size):
        return "wrong"
    return int(version)


def serve(pool: PoolClient, cmd: dict[str, Any]) -> dict[str, Any]:
    op, keys = cmd["op"], cmd.get("keys", [])
    if op == "put":
        pool.batch_put(keys, [block(k, cmd["version"], cmd["size"]) for k in keys])
        return {"ok": True}
    if op == "put_each":  # one call per key: which puts were acknowledged
        acked = []
        for k in keys:
            try:
                pool.put(k, block(k, cmd["version"], cmd["size"]))
                acked.append(True)
            except PoolUnavailable:
                acked.append(False)
        return {"acked": acked}
    if op == "get":
        bufs = [bytearray(cmd["size"]) for _ in keys]
        sizes = pool.batch_get_into(keys, bufs)
        return {"versions": [-1 if n < 0 else version_of(k, bytes(b[:n]), cmd["size"])
                             for k, b, n in zip(keys, bufs, sizes)]}
    if op == "remove":
        return {"removed": pool.batch_remove(keys)}
    if op == "members":
        return {"members": {w: info.tcp for w, info in pool.members().items()}}
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    opts = json.loads(sys.argv[1])
    expect = opts.pop("expect", 1)
    with PoolClient(**opts) as pool:
        pool.wait_for_members(lambda m: len(m) >= expect, 15)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            t0 = time.monotonic()
            try:
                reply = serve(pool, cmd)
            except KVPoolError as e:
                reply = {"error": type(e).__name__, "message": str(e)}
            reply["s"] = time.monotonic() - t0
            print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
