"""`kvpool bench engines` says how to get an engine's environment when it has none (the figures
themselves come from real engines: tests/e2e runs the same drivers)."""
from __future__ import annotations

from pathlib import Path

import pytest


def test_a_missing_engine_environment_is_one_clear_line(bench, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVPOOL_ENGINE_ENVS", str(tmp_path))  # no environment built here
    ran = bench("engines", "--quick", "--engines", "sglang")
    assert ran.rc == 2
    assert "python -m kvpool.backends.engines.envs install sglang" in ran.err
    ran = bench("engines", "--engines", "vllm", "--vllm-python", str(tmp_path / "nope"))
    assert ran.rc == 2 and "no such file" in ran.err
    ran = bench("engines", "--engines", "trt")
    assert ran.rc == 2 and "choose from vllm, sglang" in ran.err
