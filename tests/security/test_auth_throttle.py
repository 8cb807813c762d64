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


def test_sources_are_bounded_and_forgotten_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AuthThrottle, "MAX_SOURCES", 100)
    t = AuthThrottle()
    for i in range(1000):
        t.failed(f"10.0.{i // 256}.{i % 256}", "a wrong proof")
    assert len(t._failures) == 100
    assert next(iter(t._failures)) == "10.0.3.132"  # the 900th: the 900 before it went, oldest first
    assert t.failed("10.0.3.231", "again") == 2 * t.BASE_S  # a kept source's count goes on


def test_a_crowd_of_sources_logs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    t = AuthThrottle()
    with caplog.at_level(logging.DEBUG, logger="kvpool.auth"):
        for i in range(500):
            t.failed(f"10.1.{i // 256}.{i % 256}", "a wrong proof")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "10.1.0.0" in warnings[0].getMessage()
