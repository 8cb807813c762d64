"""The multihost handoff bench (tests/multihost/bench_handoff.py) runs and keeps the bench contract."""
from __future__ import annotations

from pathlib import Path

import pytest
from labbench import run_quick


@pytest.mark.timeout(400)
def test_a_handoff_between_hosts_is_measured_by_placement_against_a_raw_stream() -> None:
    result = run_quick(Path(__file__).with_name("bench_handoff.py"), 380)
    assert result["suite"] == "handoff-multihost"
    assert set(result["ratios"]) == {"handoff_by_hash_vs_raw_socket_oneway", "handoff_local_vs_raw_socket_oneway"}
    assert all(r > 0 for r in result["ratios"].values())
