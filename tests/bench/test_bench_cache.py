"""`kvpool bench cache` end to end on the embedded pool and on local workers: the achieved hit rate
is the target, every hit's bytes are checked, and a second client reads back the whole window."""
from __future__ import annotations

import pytest

from benchhelp import SMALL


def test_quick_run_reaches_target_hit_rate(bench) -> None:
    ran = bench("cache", "--quick", "--json", "--ops", "1500", "--hit-rate", "0.6", *SMALL)
    assert ran.rc == 0
    m = ran.json["metrics"]
    assert ran.json["suite"] == "cache" and set(ran.json["ratios"]) == {"get_vs_memcpy"}
    assert m["hit_rate"] == pytest.approx(0.6, abs=0.03)
    assert m["ops"] == 1500 and m["wrong_blocks"] == 0
    assert m["tier_hits_dram"] + m["tier_misses"] == m["gets"]
    assert m["readback_keys"] == 64 and m["readback_hit_rate"] == 1.0
    for op in ("get", "put", "get_or_create"):
        assert 0 < m[f"{op}_p50_us"] <= m[f"{op}_p90_us"] <= m[f"{op}_p99_us"] <= m[f"{op}_p999_us"]
    assert "latency (us)" in ran.out  # the summary table precedes the JSON line


def test_small_pool_with_ssd_tier_still_reaches_target(bench) -> None:
    """DRAM holds a quarter of the key pool: window draws miss in DRAM, hit on SSD or miss outright."""
    ran = bench("cache", "--json", "--ops", "800", "--hit-rate", "0.7", "--block-size", "64KiB",
                "--key-pool-size", "256", "--dram-bytes", "4MiB", "--ssd", "--inference-delay-ms", "0")
    m = ran.json["metrics"]
    assert ran.rc == 0 and m["wrong_blocks"] == 0
    assert m["hit_rate"] == pytest.approx(0.7, abs=0.05)
    assert m["tier_evictions"] > 0 and m["tier_hits_ssd"] > 0


def test_batches_against_local_workers(bench) -> None:
    ran = bench("cache", "--json", "--workers", "2", "--ops", "150", "--batch-size", "4", "--hit-rate", "0.5", *SMALL)
    m = ran.json["metrics"]
    assert ran.rc == 0 and m["pool"] == "2 local workers"
    assert m["gets"] == 600 and m["wrong_blocks"] == 0
    assert m["readback_hit_rate"] == 1.0 and m["readback_wrong_blocks"] == 0
