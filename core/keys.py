"""Block keys: validation and the chained prefix hash of token blocks.

A key chain names the KV blocks of a token sequence; key i commits to every token before it, so two
prompts share exactly the keys of their common full-block prefix, in any process on any machine.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from .errors import InvalidArgument, InvalidKey

__all__ = ["Key", "MAX_KEY_BYTES", "key_bytes", "keys_bytes", "block_keys"]

Key = str | bytes

MAX_KEY_BYTES = 511
"""Longest key accepted, in bytes (UTF-8 for str keys): LMDB's largest key, so every key fits every tier."""


def key_bytes(key: Key) -> bytes:
    """Validate `key` and return its canonical bytes form (str keys are UTF-8 encoded)."""
    try:
        raw = key.encode() if type(key) is str else key
    except UnicodeEncodeError as e:
        raise InvalidKey(f"key {key!r} is not valid UTF-8 text: {e.reason}") from e
    if type(raw) is bytes and 0 < len(raw) <= MAX_KEY_BYTES:
        return raw  # the common case, kept cheap: engines send thousands of keys per call
    if isinstance(key, (bytes, bytearray, memoryview)) and type(key) is not bytes:
        return key_bytes(bytes(key))
    if isinstance(key, str) and type(key) is not str:
        return key_bytes(str.__str__(key))  # a str subclass, e.g. numpy.str_
    if not isinstance(key, (str, bytes)):
        raise InvalidKey(f"key {key!r} is a {type(key).__name__}; keys are str or bytes")
    if not raw:
        raise InvalidKey(f"key is empty; keys are 1 to {MAX_KEY_BYTES} bytes")
    raise InvalidKey(f"key {raw[:16]!r}… is {len(raw)} bytes; the limit is {MAX_KEY_BYTES}")


def keys_bytes(keys: Sequence[Key], *, lengths: bool = True) -> list[bytes]:
    """`key_bytes` of each key, validated in bulk: for a batch of str keys (or of bytes keys) a few
    C-level passes (encode, lengths) instead of a Python call per key. Raises as `key_bytes` would.

    `lengths=False` skips the length check, for lookups that check only the keys they do not find
    (every stored key is valid, so a key found is one)."""
    raw: list[bytes]
    try:
        raw = list(map(str.encode, keys))  # type: ignore[arg-type]  # a bytes key raises TypeError
    except TypeError:  # not all str: all bytes, or a mix the per-key path sorts out
        if set(map(type, keys)) != {bytes}:
            return [key_bytes(k) for k in keys]
        raw = list(keys)  # type: ignore[arg-type]  # all bytes: checked above
    except UnicodeEncodeError:
        return [key_bytes(k) for k in keys]  # raises, naming the key
    if not lengths:
        return raw
    sizes = list(map(len, raw))
    if sizes and (not min(sizes) or max(sizes) > MAX_KEY_BYTES):
        return [key_bytes(k) for k in keys]  # raises, naming the first bad key
    return raw


def block_keys(token_ids: Sequence[int] | np.ndarray, block_size: int, namespace: str = "") -> list[str]:
    """Chained SHA-256 keys (64 hex chars) of each *full* block of `block_size` tokens.

    key[i] = sha256(key[i-1] || len(namespace) || namespace || block i as little-endian int64). A trailing
    partial block gets no key. Stable across processes, machines and Python versions.
    """
    if block_size <= 0:
        raise InvalidArgument(f"block_size is {block_size}; it must be > 0 tokens")
    tokens = np.ascontiguousarray(np.asarray(token_ids, dtype="<i8"))
    ns = namespace.encode()
    ns = len(ns).to_bytes(4, "little") + ns
    keys: list[str] = []
    prev = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.sha256(prev)
        h.update(ns)
        h.update(tokens[start:start + block_size].tobytes())
        prev = h.digest()
        keys.append(prev.hex())
    return keys
