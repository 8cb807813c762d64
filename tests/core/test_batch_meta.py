"""Batch metadata (`protocol.pack_batch` / `unpack_batch`) round-trips keys exactly, whether they are
all of one length or not, NUL bytes included; anything truncated is a ProtocolError, a key of a length
out of range too. Each holds of both ways the keys are cut: the extension's `split_keys` and the Python
one that stands in for it where no compiler built it."""
from __future__ import annotations

import numpy as np
import pytest

from kvpool.core import protocol as P
from kvpool.core.errors import ProtocolError
from kvpool.core.keys import MAX_KEY_BYTES


@pytest.fixture(params=["native", "python"], autouse=True)
def split(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(P, "_split_keys", P._py_split_keys)
    else:
        assert P._split_keys is not P._py_split_keys  # CI builds the extension
    return str(request.param)


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


@pytest.mark.parametrize("bad", [0, MAX_KEY_BYTES + 1, 0xFFFF])
def test_a_key_length_out_of_range_is_named(bad: int) -> None:
    good = P.pack_batch([b"ab", b"cd"], np.zeros(2, dtype="<i8"))
    meta = bytearray(good)
    meta[6:8] = bad.to_bytes(2, "little")  # the second key's length
    with pytest.raises(ProtocolError, match=f"key of {bad} bytes") as e:
        P.unpack_batch(bytes(meta), "<i8")
    assert (e.value.size, e.value.limit) == (bad, MAX_KEY_BYTES)


def test_lengths_past_the_end_are_a_protocol_error() -> None:
    """A count of keys whose lengths alone run past the metadata (a header that lies)."""
    with pytest.raises(ProtocolError):
        P.unpack_batch((1000).to_bytes(4, "little") + b"\x01\x00a", "<i8")
