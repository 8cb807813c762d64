"""The worker's throttle of failed authentications (`kvpool.core.auth.AuthThrottle`) against many source
addresses: an IPv6 host holds a whole /64, so its addresses are one source; the bookkeeping stays bounded
and each failure costs the same however many sources were seen; a crowd of sources does not flood the log."""
from __future__ import annotations

import logging

import pytest

from kvpool.core.auth import AuthThrottle, source_of


def test_an_ipv6_hosts_addresses_are_one_source() -> None:
    t = AuthThrottle()
    delays = [t.failed(f"2001:db8:1:2::{i:x}", "a wrong proof") for i in range(1, 6)]
    assert delays == [min(t.MAX_S, t.BASE_S * 2 ** i) for i in range(5)]  # doubling across the /64
    assert t.failed("2001:db8:1:3::1", "a wrong proof") == t.BASE_S  # another /64: a source of its own
    assert source_of("::ffff:10.0.0.7") == "10.0.0.7" and source_of("10.0.0.7") == "10.0.0.7"
    assert source_of("uid 1001") == "uid 1001"


def test_sources_are_bounded_and_a_crowd_does_not_push_a_guesser_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AuthThrottle, "MAX_SOURCES", 100)
    t = AuthThrottle()
    for _ in range(6):
        t.failed("192.0.2.1", "a guess")  # at the longest delay
    for i in range(1000):  # a crowd of one-time sources past the bound: answered at the longest delay
        assert t.failed(f"10.0.{i // 256}.{i % 256}", "a wrong proof") == (t.BASE_S if i < 99 else t.MAX_S)
    assert len(t._failures) == 100
    assert t.failed("192.0.2.1", "again") == t.MAX_S  # still counted
    t.succeeded("192.0.2.2")  # a neighbour with the token forgets nothing of it
    t.succeeded("192.0.2.1")
    assert t.failed("192.0.2.1", "again") == t.MAX_S


def test_a_crowd_of_sources_logs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    t = AuthThrottle()
    with caplog.at_level(logging.DEBUG, logger="kvpool.auth"):
        for i in range(500):
            t.failed(f"10.1.{i // 256}.{i % 256}", "a wrong proof")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "10.1.0.0" in warnings[0].getMessage()
