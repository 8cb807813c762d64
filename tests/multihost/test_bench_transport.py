"""The multihost transport bench (tests/multihost/bench_transport.py) runs and keeps the bench contract."""
from __future__ import annotations

from pathlib import Path

import pytest
from labbench import run_quick


@pytest.mark.timeout(300)
def test_tcp_between_hosts_is_measured_against_a_raw_socket_between_them() -> None:
    result = run_quick(Path(__file__).with_name("bench_transport.py"), 280)
    assert result["suite"] == "transport-multihost"
    assert set(result["ratios"]) == {f"tcp_{op}_vs_raw_socket{tag}" for op in ("get", "put") for tag in ("", "_64k")}
    assert all(r > 0 for r in result["ratios"].values())
