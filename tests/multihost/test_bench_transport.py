"""The multihost transport bench (tests/multihost/bench_transport.py) runs and keeps the bench contract."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from netlab import can_build


@pytest.mark.timeout(300)
def test_tcp_between_hosts_is_measured_against_a_raw_socket_between_them() -> None:
    why_not = can_build()
    if why_not:
        pytest.skip(f"multihost tests: {why_not}")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("bench_transport.py")), "--quick"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["suite"] == "transport-multihost"
    assert set(result["ratios"]) == {f"tcp_{op}_vs_raw_socket{tag}" for op in ("get", "put") for tag in ("", "_64k")}
    assert all(r > 0 for r in result["ratios"].values())
