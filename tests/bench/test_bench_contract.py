"""The `--quick --json` contract of the suites cheap enough to run here (streams has its own test):
the last stdout line is {"suite", "metrics", "ratios"}, latencies come as p50..p999."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("suite,argv,ratio", [
    ("core", ["--working-set", "16MiB"], "dram_get_vs_memcpy"),
    ("transport", [], "tcp_get_vs_raw_socket"),
    ("scale", ["--keys", "20000"], "reopen_vs_lmdb_key_scan"),
])
def test_quick_json_contract(bench, suite: str, argv: list[str], ratio: str) -> None:
    ran = bench(suite, "--quick", "--json", *argv)
    assert ran.rc == 0
    assert set(ran.json) == {"suite", "metrics", "ratios"} and ran.json["suite"] == suite
    assert ran.json["ratios"][ratio] > 0
    if suite == "transport":
        m = ran.json["metrics"]
        assert 0 < m["tcp_get_64k_p50_us"] <= m["tcp_get_64k_p90_us"] <= m["tcp_get_64k_p999_us"]
        paths = ("shm_get_vs_memcpy", "shm_put_vs_memcpy", "tcp_get_vs_raw_socket", "tcp_put_vs_raw_socket")
        assert all(ran.json["ratios"][f"{p}{size}"] > 0 for p in paths for size in ("", "_1m", "_256k", "_64k", "_16k"))
    if suite == "scale":
        m = ran.json["metrics"]
        assert m["reopen_s_per_million"] > 0 and m["ssd_keys"] == 20000 and not m["prefix_match_at_1m_measured"]
        assert m["prefix_match_4096_us_at_10k"] > 0 and m["ssd_index_bytes_per_key"] > 0 and m["full_gc_ms_at_100k"] > 0
        assert ran.json["ratios"]["class_shift_put_vs_free_room_at_100k"] > 0
        assert ran.json["ratios"]["prefix_match_vs_dict_loop_at_100k"] > 0
