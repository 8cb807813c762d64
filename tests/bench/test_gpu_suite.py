"""`kvpool bench gpu`: GPU tensors to and from the pool vs torch's pinned copy. On CPU-only machines it
measures nothing and says so (exit status 77, a JSON line with the reason); the same path runs on
CPU tensors with `--device cpu`, and on a CUDA device where there is one."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvpool.core.bench import compare
from kvpool.core.bench.gpu_suite import EXIT_SKIPPED

from benchhelp import Ran

RATIOS = {"gpu_h2d_vs_torch", "gpu_d2h_vs_torch", "gpu_h2d_vs_torch_64k", "gpu_d2h_vs_torch_64k"}


def test_the_cpu_tensor_path_measures_and_checks_bytes(bench: Callable[..., Ran]) -> None:
    ran = bench("gpu", "--quick", "--device", "cpu", "--json")
    assert ran.rc == 0
    assert set(ran.json["ratios"]) == RATIOS and all(v > 0 for v in ran.json["ratios"].values())
    m = ran.json["metrics"]
    assert m["measured"] is True and m["device"] == "cpu" and m["pool_h2d_gbps"] > 0 and m["torch_d2h_64k_gbps"] > 0


def test_without_cuda_it_says_so_and_exits_77(bench: Callable[..., Ran], monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = bench("gpu", "--quick", "--json")
    assert ran.rc == EXIT_SKIPPED == 77
    assert "skipped: no CUDA device" in ran.out
    assert ran.json["suite"] == "gpu" and "no CUDA device" in ran.json["skipped"] and ran.json["ratios"] == {}
    assert not ran.json["metrics"]["measured"]
    saved = tmp_path / "gpu.json"
    saved.write_text(ran.out)
    assert compare.load(saved)["skipped"] == ran.json["skipped"]  # `kvpool bench compare` reads it


def test_without_torch_it_says_how_to_install_it(bench: Callable[..., Ran], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    ran = bench("gpu", "--json")
    assert ran.rc == EXIT_SKIPPED and "pip install -e '.[torch]'" in ran.json["skipped"]


def test_an_unknown_device_is_a_usage_error(bench: Callable[..., Ran]) -> None:
    ran = bench("gpu", "--device", "tpu")
    assert ran.rc == 2 and "--device 'tpu': expected auto, cpu, cuda or cuda:N" in ran.err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_device(bench: Callable[..., Ran]) -> None:
    ran = bench("gpu", "--quick", "--json")
    assert ran.rc == 0
    assert ran.json["metrics"]["device"] == "cuda" and ran.json["metrics"]["device_name"]
    assert set(ran.json["ratios"]) == RATIOS and all(v > 0 for v in ran.json["ratios"].values())
