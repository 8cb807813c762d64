"""Producer: publish notifications and payloads to a stream; large payloads go by reference.

Payloads of at most `inline_max` bytes travel inside the NATS message. Larger ones are put in the pool
(PoolClient) and the message carries only their keys, sizes and checksums, so NATS never carries bulk
bytes. The prefill side of a KV handoff uses `publish_kv` per layer and `end_request` when done.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from kvpool.core.buffers import readable
from kvpool.core.client import PoolClient
from kvpool.core.errors import ConfigError
from kvpool.core.keys import Key

from . import envelope as env
from ._link import Link
from .admin import check_token, subject
from .payload import put_blocks, put_payload

INLINE_MAX = 256 << 10
"""Default largest payload sent inline, in bytes."""


class Producer:
    """Publishes to stream `stream` (which must exist: `create_stream`). Not thread-safe.

    `pool` is needed only for payloads larger than `inline_max` bytes and for `publish_kv`.
    A publish to a full stream with discard=new raises `StreamFull`; one to a missing stream raises
    `StreamNotFound`.
    """

    def __init__(self, stream: str, nats_url: str, pool: PoolClient | None = None, *,
                 inline_max: int = INLINE_MAX, timeout_s: float = 5.0) -> None:
        self.stream = check_token(stream, "stream name")
        if inline_max < 0:
            raise ConfigError(f"inline_max is {inline_max}; it must be >= 0 bytes")
        self.pool, self.inline_max = pool, inline_max
        self._link = Link(nats_url, timeout_s)

    def publish(self, data: Any, *, topic: str = "msg", headers: dict[str, str] | None = None) -> int:
        """Publish a dict/list (as JSON) or a bytes-like/numpy/torch payload; returns its stream sequence.

        `topic` is the last subject token (consumers may filter on it)."""
        hdrs = dict(headers or {})
        if isinstance(data, (dict, list)):
            view = memoryview(json.dumps(data).encode())
            hdrs[env.TYPE] = "json"
        else:
            view = readable(data)
            hdrs[env.TYPE] = "bytes"
        subj = subject(self.stream, check_token(topic, "topic"))
        if len(view) <= self.inline_max:
            return self._send(subj, bytes(view), {**hdrs, env.KIND: env.INLINE})
        ref = put_payload(self._need_pool(f"a payload of {len(view)} bytes"),
                          f"kvpool.stream/{self.stream}/{uuid.uuid4().hex}", view)
        return self._send_ref(subj, ref, {**hdrs, env.KIND: env.REF}, drop_on_failure=True)

    def publish_kv(self, request_id: str, layer: int, block_keys: Sequence[Key], tensors: Sequence[Any]) -> int:
        """Put one layer's KV blocks in the pool under `block_keys` and announce them to the decode side.

        `tensors`: one buffer (bytes-like, numpy, torch) per key. Returns the message's stream sequence."""
        if len(block_keys) != len(tensors):
            raise ValueError(f"{len(block_keys)} block keys but {len(tensors)} tensors")
        subj = subject(self.stream, "req", check_token(request_id, "request id"))
        ref = put_blocks(self._need_pool("publish_kv"), block_keys, tensors, request=request_id, layer=layer)
        return self._send_ref(subj, ref, {env.KIND: env.KV}, drop_on_failure=False)

    def end_request(self, request_id: str, layers: int | None = None) -> int:
        """Tell the decode side that request `request_id` has no more layers."""
        body = json.dumps({"request": request_id, "layers": layers}).encode()
        return self._send(subject(self.stream, "req", check_token(request_id, "request id")), body,
                          {env.KIND: env.END, env.TYPE: "json"})

    def _need_pool(self, what: str) -> PoolClient:
        if self.pool is None:
            raise ConfigError(f"{what} goes by reference (above inline_max={self.inline_max} bytes) and "
                              "needs a PoolClient: Producer(..., pool=PoolClient(...))")
        return self.pool

    def _send_ref(self, subj: str, ref: env.Ref, headers: dict[str, str], *, drop_on_failure: bool) -> int:
        """Publish a reference; if that fails, blocks under keys we made up are removed (nobody can
        ever learn their names), while the caller's own KV block keys are left alone."""
        try:
            return self._send(subj, ref.encode(), headers)
        except BaseException:
            if drop_on_failure and self.pool is not None:
                self.pool.remove(ref.keys)
            raise

    def _send(self, subj: str, body: bytes, headers: dict[str, str]) -> int:
        ack = self._link.call(self._link.js.publish(subj, body, stream=self.stream, headers=headers),
                              f"publish {len(body)} bytes to stream {self.stream!r}")
        return int(ack.seq)

    def close(self) -> None:
        """Disconnect from NATS (the pool client is the caller's to close)."""
        self._link.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
