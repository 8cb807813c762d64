"""Block header and checksum: the one serialization of a block, shared by the SSD tier and the wire.

A stored block is `HEADER || bytes`. The header carries the payload size, its XXH3-64 checksum, an
optional expiry and the block's version (`kvpool.core.versions`; headers of version 1, before blocks
had versions, are refused: a miss, never bytes of unknown age); `decode` refuses anything whose
magic, size or checksum disagree.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from .errors import CorruptBlock

__all__ = ["MAGIC", "HEADER_SIZE", "VERSION", "BlockMeta", "CorruptBlock", "checksum", "decode", "decode_header",
           "encode_header"]  # CorruptBlock: re-exported, the tiers catch it here

MAGIC = b"KVB1"
# magic, version, flags, size, checksum, expires (unix s; 0 = never), the block's version
_HEADER = struct.Struct("<4sHHQQdQ")
HEADER_SIZE = _HEADER.size
VERSION = 2


def checksum(data: memoryview | bytes) -> int:
    """XXH3-64 of `data` (the 64-bit member of the xxhash family; ~80 GB/s in cache here)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class BlockMeta:
    size: int
    checksum: int
    expires: float = 0.0
    version: int = 0
    """The block's version (`kvpool.core.versions`); 0: none."""


def encode_header(meta: BlockMeta) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, 0, meta.size, meta.checksum, meta.expires, meta.version)


def decode_header(raw: memoryview | bytes) -> BlockMeta:
    if len(raw) < HEADER_SIZE:
        raise CorruptBlock(f"value of {len(raw)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, _flags, size, csum, expires, block_version = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"bad magic {magic!r} or version {version}")
    return BlockMeta(size, csum, expires, block_version)


def decode(value: memoryview) -> tuple[BlockMeta, memoryview]:
    """Split a stored value into its meta and payload view, verifying size and checksum."""
    meta = decode_header(value)
    payload = value[HEADER_SIZE:]
    if len(payload) != meta.size:
        raise CorruptBlock(f"payload is {len(payload)} bytes; header says {meta.size}")
    if checksum(payload) != meta.checksum:
        raise CorruptBlock("checksum mismatch")
    return meta, payload
