"""Block header and checksum: the one serialization of a block, shared by the SSD tier and the wire.

A stored block is `HEADER || bytes`. The header carries the payload size, its XXH3-64 checksum, an
optional expiry and the block's version (`kvpool.core.versions`; headers of version 1, before blocks
had versions, are refused: a miss, never bytes of unknown age), and since header version 3 a check of
those fields (`header_check`, in the 16 bits that were flags): the payload's checksum does not cover
them, and one flipped bit in the block's version made a block newer than every later write of its key
(served stale for good). `decode` refuses anything whose magic, check, size or checksum disagree;
headers of version 2 (no check) are still read.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from .errors import CorruptBlock

__all__ = ["MAGIC", "HEADER_SIZE", "VERSION", "READABLE", "BlockMeta", "CorruptBlock", "checksum", "decode",
           "decode_header", "encode_header", "header_check"]  # CorruptBlock: re-exported, the tiers catch it here

MAGIC = b"KVB1"
# magic, version, flags, size, checksum, expires (unix s; 0 = never), the block's version
_HEADER = struct.Struct("<4sHHQQdQ")
HEADER_SIZE = _HEADER.size
VERSION = 3
READABLE = (2, 3)
"""Header versions a reader takes (2: before `header_check`)."""
_MIX = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_U64 = (1 << 64) - 1


def header_check(size: Any, csum: Any, expires_bits: Any, version: Any) -> Any:
    """16 bits of the header's fields (Python ints, or uint64 numpy arrays alike: the index scan checks
    every header in one pass). Each field is multiplied by its own odd constant (a bijection: a change
    of any bit changes the product), the products xored, and the result folded to 16 bits."""
    h = (size * _MIX[0]) ^ (csum * _MIX[1]) ^ (expires_bits * _MIX[2]) ^ (version * _MIX[3])
    if isinstance(h, int):
        h &= _U64
    h = h ^ (h >> 32)
    return (h ^ (h >> 16)) & 0xFFFF


def _bits(expires: float) -> int:
    return int(struct.unpack("<Q", struct.pack("<d", expires))[0])


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
    check = header_check(meta.size, meta.checksum, _bits(meta.expires), meta.version)
    return _HEADER.pack(MAGIC, VERSION, check, meta.size, meta.checksum, meta.expires, meta.version)


def decode_header(raw: memoryview | bytes) -> BlockMeta:
    if len(raw) < HEADER_SIZE:
        raise CorruptBlock(f"value of {len(raw)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, check, size, csum, expires, block_version = _HEADER.unpack_from(raw)
    if magic != MAGIC or version not in READABLE:
        raise CorruptBlock(f"bad magic {magic!r} or version {version}")
    # (version 2 wrote 0 there: a version-3 header whose version bit flipped to 2 is refused too)
    if check != (header_check(size, csum, _bits(expires), block_version) if version >= 3 else 0):
        raise CorruptBlock("header check mismatch (its size, checksum, expiry or version was altered)")
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
