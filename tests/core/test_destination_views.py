"""A batch's destinations: flat writable byte buffers are written through as they are (no objects to
finish); anything else goes through `Destination` (checked, cast, staged), and a read-only one is refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.core import buffers
from kvpool.core.buffers import byte_size, destination_views, finish_all, readable, readable_all
from kvpool.core.errors import BufferSizeError, InvalidArgument


def test_flat_byte_buffers_are_written_in_place() -> None:
    arr, ba = np.zeros(8, dtype=np.uint8), bytearray(8)
    views, dests = destination_views([arr, ba, memoryview(bytearray(3))])
    assert dests is None and [v.nbytes for v in views] == [8, 8, 3]
    views[0][:2] = b"ab"
    views[1][:2] = b"cd"
    assert arr[:2].tobytes() == b"ab" and ba[:2] == b"cd"


def test_other_buffers_go_through_destination() -> None:
    wide = np.zeros(4, dtype=np.float32)  # 16 bytes, not uint8
    views, dests = destination_views([np.zeros(2, dtype=np.uint8), wide])
    assert dests is not None and [v.nbytes for v in views] == [2, 16]
    views[1][:4] = np.float32(1.5).tobytes()
    finish_all(dests, [0, 4])
    assert wide[0] == 1.5


def test_a_read_only_buffer_is_refused() -> None:
    frozen = np.zeros(4, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(BufferSizeError):
        destination_views([frozen])
    with pytest.raises(BufferSizeError):
        destination_views([b"bytes are read-only"])


def test_byte_size_is_what_readable_gives_without_making_the_view() -> None:
    for buf in (b"abc", bytearray(7), memoryview(b"abcdef")[::2], np.zeros((3, 4), np.float32).T,
                np.arange(10, dtype=np.int64)[::3], torch.zeros(5, 3, dtype=torch.float16).t(), b""):
        assert byte_size(buf) == readable(buf).nbytes


def test_conjugate_and_negative_views_are_read_as_their_values() -> None:
    """Such views have no bytes of their own (a bit says conjugate, or negate, on access): their values
    are made real first, not a torch error."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert bytes(readable(x.conj())) == x.conj().resolve_conj().numpy().tobytes()
    assert bytes(readable(x.conj().imag)) == (-x.imag).numpy().tobytes()


_BATCHES = [
    [b"abc", bytearray(b"de"), memoryview(b"fgh"), b""],  # flat byte buffers: viewed in one C call
    list(np.arange(256, dtype=np.uint8).reshape(4, 64)),  # numpy rows, as engines and the bench put them
    [np.zeros(3, np.uint8), np.arange(4, dtype=np.float32)],  # not all bytes: the Python path takes it
    [b"x", memoryview(b"abcdef")[::2]],  # a strided view: copied, by the Python path
    [b"x", np.arange(12, dtype=np.uint8).reshape(3, 4)],  # two dimensions
    [torch.arange(6, dtype=torch.uint8), b"y"],  # a tensor exports no buffer
    [b"x", 3],  # not a buffer at all: the Python path names it
]


@pytest.mark.parametrize("batch", _BATCHES, ids=range(len(_BATCHES)))
def test_a_batch_is_read_as_each_of_its_buffers_would_be(batch: list[object]) -> None:
    """`readable_all` of a batch gives what `readable` gives of each buffer, by whichever path it takes."""
    try:
        want: object = [bytes(readable(b)) for b in batch]
    except InvalidArgument as e:
        want = type(e)
    try:
        views = readable_all(batch)
        got: object = [bytes(v) for v in views]
        assert all(v.format == "B" and v.ndim == 1 and v.c_contiguous for v in views)
    except InvalidArgument as e:
        got = type(e)
    assert got == want


def test_the_batch_path_takes_flat_byte_buffers_only() -> None:
    """The C path is built here (CI builds it), and leaves every other batch to the Python path."""
    assert buffers._readable_views is not None
    took = [buffers._readable_views(b) is not None for b in _BATCHES]
    assert took == [True, True, False, False, False, False, False]
