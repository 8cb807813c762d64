"""Every nats-py failure a stream call can meet comes back as a typed stream error."""
from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from kvpool.streams import StreamError, StreamFull, StreamNotFound, StreamTimeout, StreamUnavailable
from kvpool.streams._link import Link, translate


def _api(code: int, desc: str) -> nats.js.errors.APIError:
    return nats.js.errors.APIError(code=400, err_code=code, description=desc)


@pytest.mark.parametrize(("err", "kind", "text"), [
    (_api(10077, "maximum messages exceeded"), StreamFull, "max_msgs"),
    (_api(10077, "maximum bytes exceeded"), StreamFull, "max_bytes"),
    (_api(10059, "stream not found"), StreamNotFound, "stream not found"),
    (nats.js.errors.NotFoundError(), StreamNotFound, ""),
    (nats.js.errors.NoStreamResponseError(), StreamNotFound, "no stream"),
    (_api(10999, "something else"), StreamError, "10999"),
    (nats.errors.TimeoutError(), StreamTimeout, "timed out"),
    (TimeoutError(), StreamTimeout, "timed out"),
    (nats.errors.NoServersError(), StreamUnavailable, "unavailable"),
    (nats.errors.ConnectionClosedError(), StreamUnavailable, "unavailable"),
    (ConnectionRefusedError(), StreamUnavailable, "unavailable"),
    (nats.errors.BadSubjectError(), StreamError, "publish"),
])
def test_nats_errors_map_to_stream_errors(err, kind, text):
    out = translate(err, "publish 5 bytes")
    assert type(out) is kind and text in str(out)


def test_other_exceptions_pass_through_unchanged():
    err = ValueError("x")
    assert translate(err, "anything") is err


def test_unreachable_server_is_stream_unavailable():
    with pytest.raises(StreamUnavailable, match="127.0.0.1:1"):
        Link("nats://127.0.0.1:1", timeout_s=0.5)
