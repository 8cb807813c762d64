"""The `--quick --json` contract of the suites cheap enough to run here (streams has its own test):
the last stdout line is {"suite", "metrics", "ratios"}, latencies come as p50..p999."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("suite,argv,ratio", [
    ("core", ["--working-set", "16MiB"], "dram_get_vs_memcpy"),
    ("transport", [], "tcp_get_vs_raw_socket"),
])
def test_quick_json_contract(bench, suite: str, argv: list[str], ratio: str) -> None:
    ran = bench(suite, "--quick", "--json", *argv)
    assert ran.rc == 0
    assert set(ran.json) == {"suite", "metrics", "ratios"} and ran.json["suite"] == suite
    assert ran.json["ratios"][ratio] > 0
    if suite == "transport":
        m = ran.json["metrics"]
        assert 0 < m["tcp_get_64k_p50_us"] <= m["tcp_get_64k_p90_us"] <= m["tcp_get_64k_p999_us"]
