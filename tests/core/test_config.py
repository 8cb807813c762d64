"""Configuration: defaults < file (TOML/JSON) < KVPOOL_* environment < keyword overrides."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.core import CacheConfig, ConfigError, KVPoolError, TieredCache
from kvpool.core.config import load, parse_size
from kvpool.core.tiers.dram import arena_names

from corehelp import MiB


@pytest.mark.parametrize("text, n", [
    ("1048576", 1 << 20), (4096, 4096), ("64MiB", 64 << 20), ("64 mib", 64 << 20), ("1.5GB", 1_500_000_000),
    ("4GiB", 4 << 30), ("512k", 512_000), ("2KiB", 2048), ("7b", 7), (" 3 MB ", 3_000_000),
])
def test_parse_size(text: str | int, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-5MiB", "1e6"])
def test_bad_sizes_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


def test_defaults_work_on_a_laptop() -> None:
    cfg = CacheConfig()
    assert cfg.dram_bytes == 1 << 30 and cfg.ssd_path is None and cfg.device is None
    assert 0 < cfg.low_watermark < cfg.high_watermark <= 1 and cfg.policy == "lru"


def test_environment(monkeypatch: pytest.MonkeyPatch, make_cache: Callable[..., TieredCache]) -> None:
    monkeypatch.setenv("KVPOOL_DRAM_BYTES", "64MiB")
    monkeypatch.setenv("KVPOOL_DRAM_SLAB_SIZE", "2MiB")
    monkeypatch.setenv("KVPOOL_PREFAULT", "0")
    monkeypatch.setenv("KVPOOL_HIGH_WATERMARK", "0.9")
    monkeypatch.setenv("KVPOOL_SSD_SYNC", "false")
    monkeypatch.setenv("KVPOOL_POLICY", "fifo")
    cfg = load(CacheConfig)
    assert (cfg.dram_bytes, cfg.dram_slab_size, cfg.prefault) == (64 * MiB, 2 * MiB, False)
    assert cfg.high_watermark == 0.9 and cfg.ssd_sync is False and cfg.policy == "fifo"
    cache = TieredCache()  # the cache reads the same environment
    try:
        assert cache.config == cfg
        assert cache.stats().dram_capacity == 64 * MiB and cache.max_block == 2 * MiB
    finally:
        cache.close()


def test_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kvpool.toml"
    path.write_text(
        'dram_bytes = "48MiB"\n'
        "dram_slab_size = 1048576\n"
        "prefault = false\n"
        'ssd_path = "/var/tmp/kvpool-test"\n'
        "low_watermark = 0.5\n"
        "[worker]\n"
        "port = 1\n"
    )
    cfg = load(CacheConfig, file=path)
    assert (cfg.dram_bytes, cfg.dram_slab_size, cfg.prefault) == (48 * MiB, MiB, False)
    assert cfg.ssd_path == "/var/tmp/kvpool-test" and cfg.low_watermark == 0.5
    monkeypatch.setenv("KVPOOL_CONFIG", str(path))  # the file can also be named by the environment
    assert load(CacheConfig) == cfg


def test_a_setting_no_config_class_knows_is_a_config_error(tmp_path: Path) -> None:
    """A misspelt setting (or a table) no config class knows, at a file's top level, is refused by name,
    not dropped; a top-level setting of another class (`port`, a worker's) is not this class's business."""
    path = tmp_path / "kvpool.toml"
    path.write_text('dram_bytes = "48MiB"\nport = 1\nsome_future_option = "x"\n')
    with pytest.raises(ConfigError, match="some_future_option"):
        load(CacheConfig, file=path, env={})
    path.write_text('dram_bytes = "48MiB"\n[cahce]\ndram_bytes = "1MiB"\n')
    with pytest.raises(ConfigError, match="cahce"):
        load(CacheConfig, file=path, env={})
    path.write_text('dram_bytes = "48MiB"\nport = 1\n')
    assert load(CacheConfig, file=path, env={}).dram_bytes == 48 * MiB


def test_json_file_and_a_section(tmp_path: Path) -> None:
    path = tmp_path / "kvpool.json"
    path.write_text(json.dumps({"cache": {"dram_bytes": "40MiB", "prefault": False, "low_watermark": 0.7},
                                "dram_bytes": 1}))
    cfg = load(CacheConfig, file=path, section="cache")
    assert cfg.dram_bytes == 40 * MiB and cfg.prefault is False and cfg.low_watermark == 0.7


def test_precedence_file_then_environment_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dram_bytes": "10MiB", "dram_slab_size": "1MiB", "policy": "fifo"}))
    env = {"KVPOOL_DRAM_BYTES": "20MiB", "KVPOOL_CONFIG": str(path)}
    cfg = load(CacheConfig, env=env)
    assert cfg.dram_bytes == 20 * MiB and cfg.dram_slab_size == MiB and cfg.policy == "fifo"
    cfg = load(CacheConfig, env=env, dram_bytes=30 * MiB)
    assert cfg.dram_bytes == 30 * MiB


def test_unknown_override_is_a_config_error(make_cache: Callable[..., TieredCache]) -> None:
    with pytest.raises(ConfigError, match="dram_byte") as err:
        load(CacheConfig, dram_byte=1)
    assert "dram_bytes" in str(err.value)  # the known options are listed
    before = arena_names()
    with pytest.raises(ConfigError, match="bogus"):
        TieredCache(bogus=True)
    assert arena_names() == before


@pytest.mark.parametrize("low, high", [(0.9, 0.8), (0.5, 0.5), (0.0, 0.5), (0.5, 1.5), (-1, 0.5)])
def test_bad_watermarks_are_config_errors(low: float, high: float) -> None:
    with pytest.raises(ConfigError, match="watermark") as err:
        CacheConfig(low_watermark=low, high_watermark=high)
    assert str(low) in str(err.value) and str(high) in str(err.value)


def test_bad_watermark_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_HIGH_WATERMARK", "0.5")  # below the default low watermark
    with pytest.raises(ConfigError, match="watermark"):
        TieredCache(dram_bytes=4 * MiB, dram_slab_size=MiB, prefault=False)


def test_bad_values_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="smaller than one slab"):
        load(CacheConfig, dram_bytes="1MiB", dram_slab_size="2MiB")
    with pytest.raises(ConfigError, match="lots"):
        load(CacheConfig, dram_bytes="lots")
    with pytest.raises(ConfigError, match="high_watermark"):
        load(CacheConfig, high_watermark="high")
    with pytest.raises(ConfigError, match="policy 'mru'"):
        TieredCache(dram_bytes=4 * MiB, dram_slab_size=MiB, prefault=False, policy="mru")


def test_unreadable_config_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.toml"):
        load(CacheConfig, file=tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("dram_bytes = = 3")
    with pytest.raises(ConfigError, match="bad.toml"):
        load(CacheConfig, file=bad)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        load(CacheConfig, file=bad_json)


def test_a_failed_start_leaves_no_arena_behind(tmp_path: Path, make_cache: Callable[..., TieredCache]) -> None:
    first = make_cache(ssd_path=str(tmp_path / "ssd"))
    before = arena_names()
    with pytest.raises(KVPoolError, match="is in use by another cache of this process"):  # one store per SSD folder
        TieredCache(dram_bytes=4 * MiB, dram_slab_size=MiB, prefault=False, ssd_path=str(tmp_path / "ssd"))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(OSError):
        TieredCache(dram_bytes=4 * MiB, dram_slab_size=MiB, prefault=False, ssd_path=str(not_a_dir))
    assert arena_names() == before
    first.put("still", b"works")
    assert first.get("still") == b"works"


def test_client_mode_follows_from_what_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.core.client import ClientConfig

    assert ClientConfig().mode == "embedded"
    assert ClientConfig(worker="/run/kvpool/worker.sock").mode == "local"
    assert ClientConfig(nats_url="nats://127.0.0.1:4222").mode == "cluster"
    assert ClientConfig(mode="embedded", nats_url="nats://127.0.0.1:4222").mode == "embedded"  # explicit wins
    monkeypatch.setenv("KVPOOL_NATS_URL", "nats://127.0.0.1:4222")
    assert load(ClientConfig).mode == "cluster"
    with pytest.raises(ConfigError, match="mode 'remote'"):
        ClientConfig(mode="remote")
