"""Every nats-py failure a stream call can meet comes back as a typed stream error (and one core meets,
through `kvpool.core.aio.nats_error`, as a typed KVPoolError)."""
from __future__ import annotations

import concurrent.futures
import inspect

import nats.errors
import nats.js.errors
import pytest

from kvpool.core.aio import nats_error
from kvpool.core.errors import AuthError, KVPoolError, PoolClosed, PoolTimeout, PoolUnavailable
from kvpool.streams import StreamError, StreamFull, StreamNotFound, StreamRefused, StreamTimeout, StreamUnavailable
from kvpool.streams._link import Link, translate


def _api(code: int, desc: str) -> nats.js.errors.APIError:
    return nats.js.errors.APIError(code=400, err_code=code, description=desc)


@pytest.mark.parametrize(("err", "kind", "text"), [
    (_api(10077, "maximum messages exceeded"), StreamFull, "max_msgs"),
    (_api(10077, "maximum bytes exceeded"), StreamFull, "max_bytes"),
    (_api(10059, "stream not found"), StreamNotFound, "stream not found"),
    (nats.js.errors.NotFoundError(), StreamNotFound, ""),
    (nats.js.errors.NoStreamResponseError(), StreamNotFound, "no stream"),
    (_api(10999, "something else"), StreamRefused, "10999"),
    (nats.js.errors.ServiceUnavailableError(code=503), StreamUnavailable, "unavailable"),
    (nats.errors.TimeoutError(), StreamTimeout, "timed out"),
    (TimeoutError(), StreamTimeout, "timed out"),
    (concurrent.futures.TimeoutError(), StreamTimeout, "timed out"),
    (nats.errors.AuthorizationError(), StreamRefused, "publish"),
    (nats.errors.NoServersError(), StreamUnavailable, "unavailable"),
    (nats.errors.ConnectionClosedError(), StreamUnavailable, "unavailable"),
    (ConnectionRefusedError(), StreamUnavailable, "unavailable"),
    (nats.errors.BadSubjectError(), StreamRefused, "publish"),
])
def test_nats_errors_map_to_stream_errors(err, kind, text):
    out = translate(err, "publish 5 bytes")
    assert type(out) is kind and text in str(out)


def _nats_exception_classes() -> list[type[BaseException]]:
    found = {cls for module in (nats.errors, nats.js.errors) for _, cls in inspect.getmembers(module, inspect.isclass)
             if issubclass(cls, nats.errors.Error)}
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _instance(cls: type[BaseException]) -> BaseException:
    """An instance of a nats-py exception class, whatever its constructor wants (some need arguments)."""
    try:
        err = cls()
        str(err)
        return err
    except TypeError:  # SlowConsumerError(subject, reply, sid, sub); ConsumerSequenceMismatchError's str needs ints
        params = [p for p in inspect.signature(cls).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        return cls(*[0] * len(params))


@pytest.mark.parametrize("cls", _nats_exception_classes(), ids=lambda c: c.__qualname__)
def test_every_nats_exception_class_becomes_a_stream_error_and_a_core_error(cls):
    """Both mappings are complete (as httpx tests its map_httpcore_exceptions): no nats-py exception
    reaches a caller of streams (`translate`) or of core (`nats_error`) untranslated; timeouts stay
    TimeoutErrors."""
    out = translate(_instance(cls), "publish 5 bytes")
    assert isinstance(out, StreamError), (cls, out)
    assert isinstance(out, TimeoutError) == issubclass(cls, TimeoutError), (cls, out)
    core = nats_error(_instance(cls), "join the cluster")
    assert isinstance(core, KVPoolError) and "join the cluster" in str(core), (cls, core)
    assert isinstance(core, TimeoutError) == issubclass(cls, TimeoutError), (cls, core)


@pytest.mark.parametrize(("err", "kind"), [
    (nats.errors.TimeoutError(), PoolTimeout),
    (nats.errors.NoServersError(), PoolUnavailable),
    (ConnectionRefusedError(), PoolUnavailable),
    (nats.errors.AuthorizationError(), AuthError),
    (ValueError("x"), PoolUnavailable),  # to core, whatever keeps NATS from serving leaves the cluster away
])
def test_core_nats_errors(err, kind):
    assert type(nats_error(err, "join the cluster")) is kind
    typed = PoolClosed("closed")
    assert nats_error(typed, "anything") is typed


def test_other_exceptions_pass_through_unchanged():
    err = ValueError("x")
    assert translate(err, "anything") is err


def test_unreachable_server_is_stream_unavailable():
    with pytest.raises(StreamUnavailable, match="127.0.0.1:1"):
        Link("nats://127.0.0.1:1", timeout_s=0.5)


def test_a_closed_link_is_unavailable_and_closes_once(nats):
    link = Link(nats.url, timeout_s=2)
    link.close()
    link.close()
    with pytest.raises(StreamUnavailable, match="closed"):
        link.call(link.nc.flush(), "flush")
