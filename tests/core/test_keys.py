"""Block keys: the chained prefix hash and key validation."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvpool.core import MAX_KEY_BYTES, InvalidKey, block_keys
from kvpool.core.keys import key_bytes

# Computed once from the documented formula; a change here breaks every stored pool.
GOLDEN_0_8_BS4 = [
    "80dde43b7b4019673061ddd8b74236919317b08174f0227223d59ac624def0be",
    "e2151f28efcbf58aad86de59717bdea5ba23af04f52142bd95d61a5d96b769b5",
]
GOLDEN_0_8_BS4_LLAMA = [
    "2c04e0970535be937363c3afb76e4093640aca36fe2b5d0b809bb64b89cdccb3",
    "fd820ccb970b41181630a038f2fea8367e50325802c56596c6e728e908d3fe29",
]


def test_block_keys_golden_value() -> None:
    assert block_keys(list(range(8)), 4) == GOLDEN_0_8_BS4
    assert block_keys(list(range(8)), 4, namespace="llama") == GOLDEN_0_8_BS4_LLAMA


def test_block_keys_follow_the_documented_formula() -> None:
    ns = b"m"
    prev = b""
    expected = []
    for block in ([5, 6, 7], [8, 9, 10]):
        h = hashlib.sha256(prev + len(ns).to_bytes(4, "little") + ns
                           + b"".join(t.to_bytes(8, "little", signed=True) for t in block))
        prev = h.digest()
        expected.append(prev.hex())
    assert block_keys([5, 6, 7, 8, 9, 10], 3, namespace="m") == expected


def test_block_keys_accept_lists_and_arrays_alike() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert block_keys(np.array(tokens, dtype=np.int32), 4) == block_keys(tokens, 4)
    assert block_keys(tuple(tokens), 4) == block_keys(tokens, 4)


def test_block_keys_are_chained() -> None:
    a = list(range(100, 132))
    b = a[:16] + [7] * 16
    ka, kb = block_keys(a, 4), block_keys(b, 4)
    assert len(ka) == len(kb) == 8
    assert ka[:4] == kb[:4]  # common full-block prefix, common keys
    assert all(x != y for x, y in zip(ka[4:], kb[4:]))
    # a change in block 1 changes key 1 and every later key, although later blocks are equal
    c = list(a)
    c[5] += 1
    kc = block_keys(c, 4)
    assert kc[0] == ka[0]
    assert all(x != y for x, y in zip(kc[1:], ka[1:]))
    assert len(set(ka)) == len(ka)


def test_partial_trailing_block_gets_no_key() -> None:
    assert block_keys(list(range(11)), 4) == block_keys(list(range(8)), 4)
    assert block_keys(list(range(3)), 4) == []
    assert block_keys([], 4) == []
    assert len(block_keys(list(range(12)), 4)) == 3


def test_namespace_changes_every_key() -> None:
    tokens = list(range(16))
    plain, a, b = block_keys(tokens, 4), block_keys(tokens, 4, "a"), block_keys(tokens, 4, "b")
    assert len({*plain, *a, *b}) == 12
    # the namespace is length-prefixed: moving a byte between namespace and tokens cannot collide
    assert block_keys(tokens, 4, "ab") != block_keys(tokens, 4, "a")


def test_block_keys_are_fixed_width_hex() -> None:
    for k in block_keys(list(range(64)), 16, "ns"):
        assert len(k) == 64 and int(k, 16) >= 0
        assert key_bytes(k) == k.encode()


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size is 0"):
        block_keys([1, 2], 0)


@pytest.mark.parametrize("key, expected", [
    ("abc", b"abc"), (b"abc", b"abc"), (bytearray(b"abc"), b"abc"), (memoryview(b"abc"), b"abc"),
    ("é", "é".encode()), ("x" * MAX_KEY_BYTES, b"x" * MAX_KEY_BYTES),
])
def test_valid_keys(key: object, expected: bytes) -> None:
    assert key_bytes(key) == expected  # type: ignore[arg-type]


def test_subclasses_of_str_and_bytes_are_keys() -> None:
    # numpy string scalars (keys read out of an array) are str subclasses
    assert key_bytes(np.array(["blk-1"])[0]) == b"blk-1"
    assert key_bytes(np.bytes_(b"blk-2")) == b"blk-2"


def test_empty_key_is_invalid() -> None:
    for key in ("", b"", bytearray()):
        with pytest.raises(InvalidKey, match="empty"):
            key_bytes(key)


def test_too_long_key_names_size_and_limit() -> None:
    with pytest.raises(InvalidKey) as err:
        key_bytes("k" * (MAX_KEY_BYTES + 1))
    assert str(MAX_KEY_BYTES + 1) in str(err.value) and str(MAX_KEY_BYTES) in str(err.value)
    # the limit is in bytes, not characters
    with pytest.raises(InvalidKey, match=str(MAX_KEY_BYTES)):
        key_bytes("é" * (MAX_KEY_BYTES // 2 + 1))


@pytest.mark.parametrize("key", [None, 42, 1.5, ["a"], ("a",), object()])
def test_wrong_type_is_invalid(key: object) -> None:
    with pytest.raises(InvalidKey, match=type(key).__name__):
        key_bytes(key)  # type: ignore[arg-type]


def test_unencodable_str_is_invalid() -> None:
    with pytest.raises(InvalidKey):
        key_bytes("bad\ud800key")


def test_invalid_key_is_a_value_error_and_a_kvpool_error() -> None:
    from kvpool.core import KVPoolError

    assert issubclass(InvalidKey, ValueError) and issubclass(InvalidKey, KVPoolError)
