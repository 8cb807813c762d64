"""The multihost handoff bench (tests/multihost/bench_handoff.py) runs and keeps the bench contract."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from netlab import can_build


@pytest.mark.timeout(400)
def test_a_handoff_between_hosts_is_measured_by_placement_against_a_raw_stream() -> None:
    why_not = can_build()
    if why_not:
        pytest.skip(f"multihost tests: {why_not}")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("bench_handoff.py")), "--quick"],
                         capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["suite"] == "handoff-multihost"
    assert set(result["ratios"]) == {"handoff_by_hash_vs_raw_socket_oneway", "handoff_local_vs_raw_socket_oneway"}
    assert all(r > 0 for r in result["ratios"].values())
