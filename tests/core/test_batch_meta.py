"""Batch metadata (`protocol.pack_batch` / `unpack_batch`) round-trips keys exactly, whether they are
all of one length (cut by numpy) or not, NUL bytes included; anything truncated is a ProtocolError."""
from __future__ import annotations

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.errors import ProtocolError


@pytest.mark.parametrize("keys", [
    [f"layer-{i:03d}".encode() for i in range(64)],  # one length
    [b"a\x00", b"\x00\x00", b"\x00b"],  # one length, NULs at either end kept
    [b"a", b"bc", b"def\x00"],  # mixed lengths
    [b"k" * 511, b"j" * 511],  # the longest keys
    [],
])
def test_keys_round_trip_exactly(keys: list[bytes]) -> None:
    sizes = np.arange(len(keys), dtype="<i8")
    meta = P.pack_batch(keys, sizes, sizes.astype("<u8"))
    got, (a, b) = P.unpack_batch(meta, "<i8", "<u8")
    assert got == keys and all(type(k) is bytes for k in got)
    assert a.tolist() == b.tolist() == list(range(len(keys)))
    for cut in range(1, len(meta)) if keys else ():
        with pytest.raises(ProtocolError):
            P.unpack_batch(meta[:cut], "<i8", "<u8")
    with pytest.raises(ProtocolError):
        P.unpack_batch(meta + b"\x00", "<i8", "<u8")
