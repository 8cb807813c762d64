"""`--config FILE.json` takes kvtest's key names; flags override the file; bad keys are named."""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.core.bench import cache_options
from kvpool.core.errors import ConfigError

from benchhelp import SMALL


def _args(tmp_path: Path, cfg: dict | None, *flags: str, suite: Any = cache_options) -> argparse.Namespace:
    """The options `suite` (cache's, or kvtest's) parses from `flags` and a `--config` file of `cfg`."""
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    suite.add_arguments(p)
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


SEED_INSTANCE = {"instance_id": 0, "listen_port": 8080, "rocksdb_store_dir": "./rocksdb0",
                 "remote_worker": "127.0.0.1:8081"}
SEED_TEST = {"test_mode": "cache", "key_pool_size": 10000, "inference_delay_ms": 100, "hit_rate": 0.8}


def test_the_seeds_instance_and_test_configs_together(tmp_path: Path) -> None:
    (tmp_path / "writer0.json").write_text(json.dumps(SEED_INSTANCE))
    (tmp_path / "cache.json").write_text(json.dumps(SEED_TEST))
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    cache_options.add_arguments(p)
    o = cache_options.resolve(p.parse_args(["--config", str(tmp_path / "writer0.json"),
                                            "--config", str(tmp_path / "cache.json"), "--role", "writer"]))
    inst = o.instance
    assert inst is not None and (inst.worker_id, inst.listen_port, inst.store_dir, inst.remote_worker) == \
        ("kvtest-0", 8080, "./rocksdb0", "127.0.0.1:8081")
    assert inst.nats_url == "nats://127.0.0.1:4222"
    assert (o.role, o.key_pool_size, o.inference_delay_ms, o.hit_rate) == ("writer", 10000, 100.0, 0.8)


def test_threads_rate_and_several_sizes(tmp_path: Path) -> None:
    o = cache_options.resolve(_args(tmp_path, {"num_threads": 4, "target_qps": 250, "data_sizes": ["64KiB", "1MiB"],
                                               "batch_keys_count": 2}))
    assert (o.threads, o.target_qps, o.sizes, o.batch_size) == (4, 250.0, [64 << 10, 1 << 20], 2)
    one = cache_options.resolve(_args(tmp_path, {"data_sizes": ["64KiB"]}))
    assert (one.block_size, one.sizes) == (64 << 10, [64 << 10])


def test_defaults_without_a_file(tmp_path: Path) -> None:
    o = cache_options.resolve(_args(tmp_path, None, "--quick"))
    assert (o.key_pool_size, o.hit_rate, o.block_size, o.duration) == (512, 0.8, 1 << 20, 8.0)


@pytest.mark.parametrize("cfg,named", [
    ({"key_pool_size": 10, "colour": "red", "speed": 3}, ["colour", "speed"]),
    ({"max_key_pool_size": 4, "set_param": {"ttl_second": 5}}, ["max_key_pool_size", "set_param", "not supported"]),
    ({"mode": "pipeline"}, ["mode", "'pipeline'"]),
    ({"data_sizes": []}, ["data_sizes is empty"]),
    ({"data_sizes": ["64KiB", 8]}, ["data_sizes", "16 bytes"]),
    ({"num_threads": 0}, ["num_threads 0"]),
    ({"target_qps": -1}, ["target_qps -1"]),
    ({"instance_id": 0}, ["listen_port"]),
    ({"listen_port": 8080, "remote_worker": "127.0.0.1:8081"}, ["listen_port, remote_worker", "instance_id"]),
    ({"instance_id": 0, "listen_port": 8080, "remote_worker": "nowhere"}, ["remote_worker 'nowhere'", "host:port"]),
    ({"instance_id": 0, "listen_port": 70000}, ["listen_port 70000"]),
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


def test_cache_run_with_threads_rate_and_several_sizes(bench, tmp_path: Path) -> None:
    (tmp_path / "kvtest.json").write_text(json.dumps({"num_threads": 3, "target_qps": 3000, "key_pool_size": 48,
                                                      "data_sizes": ["16KiB", "48KiB"], "inference_delay_ms": 0}))
    ran = bench("cache", "--json", "--config", str(tmp_path / "kvtest.json"), "--ops", "90", "--workers", "2",
                "--csv", str(tmp_path / "out.csv"))
    assert ran.rc == 0, ran.err
    m = ran.json["metrics"]
    assert (m["threads"], m["target_qps"], m["data_sizes"]) == (3, 3000.0, [16 << 10, 48 << 10])
    assert m["ops"] >= 90 and m["wrong_blocks"] == 0 and m["readback_wrong_blocks"] == 0
    assert m["readback_hit_rate"] == 1.0  # blocks of both sizes read back through another client
    with (tmp_path / "out.csv").open() as f:
        rows = {r["op"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"get", "put", "get_or_create"}
    assert int(rows["get_or_create"]["count"]) == m["ops"] and int(rows["get"]["fail"]) == 0


def test_kvtest_data_size_zero_is_refused(tmp_path: Path) -> None:
    """`kvpool bench kvtest --data-sizes 0` (or `"data_sizes": [0]`) is a ConfigError up front (it ran every
    mode, then died with ZeroDivisionError in the memcpy baseline)."""
    from kvpool.core.bench import kvtest_suite

    for args in (_args(tmp_path, None, "--data-sizes", "0", suite=kvtest_suite),
                 _args(tmp_path, {"data_sizes": [0]}, suite=kvtest_suite)):
        with pytest.raises(ConfigError):
            kvtest_suite.resolve(args)


def test_kvtest_listen_port_out_of_range_is_refused(tmp_path: Path) -> None:
    """An instance config's `listen_port` out of range is a ConfigError naming it (the run started a worker
    on it, which died with an OverflowError traceback)."""
    from kvpool.core.bench import kvtest_suite

    args = _args(tmp_path, {"instance_id": 0, "listen_port": 70000, "remote_worker": "127.0.0.1:8081"},
                 suite=kvtest_suite)
    with pytest.raises(ConfigError, match="listen_port"):
        kvtest_suite.resolve(args)
