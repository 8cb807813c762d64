"""`kvpool bench compare A B` prints both runs side by side with the change, from either saved form."""
from __future__ import annotations

import json
from pathlib import Path

A = {"suite": "cache", "metrics": {"hit_rate": 0.8, "throughput_gbps": 2.0, "pool": "embedded pool"},
     "ratios": {"get_vs_memcpy": 0.5, "one_block_vs_memcpy": 0.0123}}
B = {"suite": "cache", "metrics": {"hit_rate": 0.8, "throughput_gbps": 3.0, "pool": "2 local workers", "extra": 1},
     "ratios": {"get_vs_memcpy": 0.25, "one_block_vs_memcpy": 0.0246}}


def test_compare_prints_both_runs(bench, tmp_path: Path) -> None:
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "results.json").write_text(json.dumps({**A, "timeline": []}))
    (tmp_path / "b.txt").write_text("kvpool bench cache\n  table lines\n" + json.dumps(B) + "\n")
    ran = bench("compare", str(tmp_path / "rep"), str(tmp_path / "b.txt"))
    assert ran.rc == 0
    rows = {line.split()[0]: line.split() for line in ran.out.splitlines() if line.strip()}
    assert rows["throughput_gbps"][1:] == ["2.0", "3.0", "+50.0%"]
    assert rows["get_vs_memcpy"][1:] == ["0.50x", "0.25x", "-50.0%"]
    assert rows["one_block_vs_memcpy"][1:] == ["0.012x", "0.025x", "+100.0%"]  # not 0.01x and 0.02x
    assert rows["hit_rate"][1:] == ["0.8", "0.8"]
    assert rows["extra"][1:] == ["-", "1"]
    assert "differs" in ran.out  # the pool names


def test_compare_rejects_a_file_that_is_not_a_run(bench, tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(A))
    (tmp_path / "notes.txt").write_text("no json here\n")
    ran = bench("compare", str(tmp_path / "a.json"), str(tmp_path / "notes.txt"))
    assert ran.rc == 2 and "is not a kvpool bench run" in ran.err
