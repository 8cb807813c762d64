"""A batch's destinations: flat writable byte buffers are written through as they are (no objects to
finish); anything else goes through `Destination` (checked, cast, staged), and a read-only one is refused."""
from __future__ import annotations

import numpy as np
import pytest

from kvpool.core.buffers import destination_views, finish_all
from kvpool.core.errors import BufferSizeError


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
