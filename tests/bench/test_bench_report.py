"""`--report DIR` writes the results and four PNG plots; without matplotlib it fails up front,
and a run without --report never needs matplotlib (a bare install runs the README's command)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchhelp import SMALL

PNG = b"\x89PNG\r\n\x1a\n"


def test_report_writes_json_and_plots(bench, tmp_path: Path) -> None:
    ran = bench("cache", "--json", "--duration", "1.2", "--report", str(tmp_path / "rep"), *SMALL)
    assert ran.rc == 0
    results = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert results["metrics"] == ran.json["metrics"] and results["ratios"] == ran.json["ratios"]
    assert len(results["timeline"]) >= 2 and set(results["latency_cdf_us"]) == {"get", "put", "get_or_create"}
    for name in ("throughput", "latency_cdf", "hit_rate", "tier_fill"):
        data = (tmp_path / "rep" / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 1000


def test_report_without_matplotlib_is_a_clear_error(bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    ran = bench("cache", "--ops", "5", "--report", str(tmp_path / "rep"), *SMALL)
    assert ran.rc == 2 and "pip install -e '.[report]'" in ran.err
    assert not (tmp_path / "rep").exists()  # refused before running, not after


def test_runs_without_matplotlib() -> None:
    code = ("import sys; sys.modules['matplotlib'] = None; from kvpool.core.cli import main; "
            f"sys.exit(main(['bench', 'cache', '--ops', '20', *{SMALL!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "kvpool bench cache" in done.stdout
