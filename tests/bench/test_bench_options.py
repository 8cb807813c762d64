"""`--config FILE.json` takes kvtest's key names; flags override the file; bad keys are named."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from benchhelp import SMALL
from kvpool.core.bench import cache_options
from kvpool.core.errors import ConfigError


def _args(tmp_path: Path, cfg: dict | None, *flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    cache_options.add_arguments(p)
    argv = list(flags)
    if cfg is not None:
        (tmp_path / "kvtest.json").write_text(json.dumps(cfg))
        argv += ["--config", str(tmp_path / "kvtest.json")]
    return p.parse_args(argv)


KVTEST = {"mode": "cache", "pipeline": ["cacheGetOrCreate"], "key_pool_size": 100, "target_hit_rate": 0.9,
          "inference_delay_ms": 5, "data_sizes": ["256KiB"], "batch_keys_count": 8, "duration": 3}


def test_kvtest_keys_map_to_options(tmp_path: Path) -> None:
    o = cache_options.resolve(_args(tmp_path, KVTEST))
    assert (o.role, o.key_pool_size, o.hit_rate, o.inference_delay_ms) == ("both", 100, 0.9, 5.0)
    assert (o.block_size, o.batch_size, o.duration, o.ops) == (256 << 10, 8, 3.0, None)


def test_flags_override_the_file(tmp_path: Path) -> None:
    o = cache_options.resolve(_args(tmp_path, KVTEST, "--hit-rate", "0.5", "--ops", "10"))
    assert (o.hit_rate, o.key_pool_size, o.ops, o.duration) == (0.5, 100, 10, None)


@pytest.mark.parametrize("test_mode,role", [("cache", "both"), ("set_local", "writer"), ("get_cross_node", "reader")])
def test_test_mode_picks_the_role(tmp_path: Path, test_mode: str, role: str) -> None:
    o = cache_options.resolve(_args(tmp_path, {"test_mode": test_mode}, "--cluster", "nats://127.0.0.1:1"))
    assert o.role == role


def test_defaults_without_a_file(tmp_path: Path) -> None:
    o = cache_options.resolve(_args(tmp_path, None, "--quick"))
    assert (o.key_pool_size, o.hit_rate, o.block_size, o.duration) == (512, 0.8, 1 << 20, 8.0)


@pytest.mark.parametrize("cfg,named", [
    ({"key_pool_size": 10, "colour": "red", "speed": 3}, ["colour", "speed"]),
    ({"num_threads": 4, "target_qps": 100}, ["num_threads", "target_qps", "not supported"]),
    ({"mode": "pipeline"}, ["mode", "'pipeline'"]),
    ({"data_sizes": [1024, 2048]}, ["data_sizes", "one block size"]),
    ({"target_hit_rate": 80}, ["hit rate 80"]),
    ({"key_pool_size": "many"}, ["key_pool_size", "'many'"]),
    ({"role": "reader"}, ["--cluster"]),
    ([1, 2], ["one JSON object"]),
])
def test_bad_config_is_a_clear_error(tmp_path: Path, cfg: object, named: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        cache_options.resolve(_args(tmp_path, cfg))  # type: ignore[arg-type]
    for word in named:
        assert word in str(e.value)


def test_cli_reports_config_errors_without_a_traceback(bench, tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"key_pool_size": 8, "warmup": 1}')
    ran = bench("cache", "--config", str(tmp_path / "bad.json"), *SMALL)
    assert ran.rc == 2
    assert "unknown keys warmup" in ran.err and "Traceback" not in ran.err
