"""`kvpool bench backends --quick --json`: the JSON contract and the ratios the issues ask for (v1, v2,
FastDeploy), at a smaller page (1 KV head) so that it stays quick here."""
from __future__ import annotations

import json

import pytest

from kvpool.core.cli import build_parser

import sglang_pools  # noqa: F401  (SGLang imported once per session, its import warnings handled there)


def test_quick_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "backends", "--quick", "--json", "--kv-heads", "1"])
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(result) == {"suite", "metrics", "ratios"} and result["suite"] == "backends"
    m = result["metrics"]
    assert (m["pages_per_batch"], m["layers"], m["page_tokens"], m["kv_heads"], m["head_dim"]) == (64, 32, 64, 1, 128)
    assert m["batch_bytes"] == 2 * 64 * m["block_bytes"] == 2 * 64 * 32 * 64 * 1 * 128 * 2
    expected = {f"{path}_{op}_vs_memcpy{tag}" for path in ("sglang", "sglang_v2", "fastdeploy")
                for op in ("get", "set") for tag in ("", "_local")} | {"sglang_get_vs_file_backend",
                                                                         "sglang_set_vs_file_backend"}
    assert set(result["ratios"]) == expected
    assert all(v > 0 for v in result["ratios"].values())
    assert all(m[f"sglang_v2_{op}{tag}_gbps"] > 0 for op in ("put", "get") for tag in ("", "_local"))
