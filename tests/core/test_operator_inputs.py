"""The operations surface given bad or surprising input: the `kvpool` command line, configuration loading (files,
`KVPOOL_*` variables, sizes), block events' command line, kvtest's options and CSV. Each test names one
bug: bad input must give a clear typed error (never a traceback of an unrelated error, nor a silently
ignored or silently wrong setting)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.core.config import CacheConfig, WorkerConfig, load
from kvpool.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
KVPOOL = [sys.executable, "-m", "kvpool.core.cli"]


def _kvpool(tmp_path: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `kvpool ARGV` in a child process with its own state folder; a hang is killed and fails."""
    env = {**os.environ, "KVPOOL_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen([*KVPOOL, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"kvpool {' '.join(argv)} did not exit within {timeout} s (it should refuse the input):\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _clean_refusal(ran: subprocess.CompletedProcess[str], what: str) -> None:
    assert "Traceback" not in ran.stderr, f"{what}: a traceback instead of a one-line error:\n{ran.stderr[-2500:]}"
    assert ran.returncode == 2, f"{what}: exit status {ran.returncode}, want 2 (a refused input)\n{ran.stderr[-1500:]}"


# ----- sizes, numbers and booleans --------------------------------------------------------------------------

def test_malformed_size_is_a_config_error_not_a_traceback(tmp_path: Path) -> None:
    """Regression: `parse_size("1.5.2MiB")` (and ".", "1..5GiB") raises a bare ValueError from float() instead of the
    ConfigError it raises for every other bad size; `kvpool bench kvtest --data-sizes 1.5.2MiB` (which calls it
    outside `load`) dies with that traceback instead of the one-line error of a bad option."""
    from kvpool.core.config import parse_size

    for bad in ("1.5.2MiB", ".", "1..5GiB"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    _clean_refusal(_kvpool(tmp_path, "bench", "kvtest", "--data-sizes", "1.5.2MiB", "--ops", "1"),
                   "kvpool bench kvtest --data-sizes 1.5.2MiB")


def test_boolean_setting_typo_is_refused_not_taken_as_false() -> None:
    """Regression: a boolean setting that is not a boolean word (`KVPOOL_SSD_SYNC=flase`, `KVPOOL_PREFAULT=maybe`,
    `ssd_sync = "nope"` in a file) silently reads as False: a typo turns off fsync of every SSD batch (durability
    across power loss) with no word. Any spelling other than 1/true/yes/on and 0/false/no/off should be a
    ConfigError naming the variable."""
    for name, value in (("KVPOOL_SSD_SYNC", "flase"), ("KVPOOL_PREFAULT", "maybe"), ("KVPOOL_SSD_SYNC", "ture")):
        try:
            cfg = load(CacheConfig, env={name: value})
        except ConfigError:
            continue
        pytest.fail(f"{name}={value!r} was taken as {getattr(cfg, name[7:].lower())!r} without an error")


def test_dram_slab_size_zero_is_a_config_error() -> None:
    """Regression: `dram_slab_size=0` (`KVPOOL_DRAM_SLAB_SIZE=0`) passes CacheConfig's checks and the cache then dies
    with ZeroDivisionError (the arena's slab count); other bad slab sizes are a ConfigError naming the rule."""
    from kvpool.core import TieredCache

    with pytest.raises(ConfigError):
        TieredCache(load(CacheConfig, env={"KVPOOL_DRAM_SLAB_SIZE": "0", "KVPOOL_DRAM_BYTES": "64MiB"}))


# ----- config files -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,section,data", [
    (CacheConfig, "cache", {"policy": ["lru"]}),      # TypeError: unhashable type: 'list'
    (WorkerConfig, "worker", {"nats_url": 4222}),     # accepted; the worker's start: AttributeError 'int'.split
    (WorkerConfig, "worker", {"host": ["127.0.0.1"]}),
], ids=["policy-list", "nats_url-int", "host-list"])
def test_wrongly_typed_file_setting_is_a_config_error(tmp_path: Path, cls: type, section: str, data: dict) -> None:
    """Regression: a config file value of the wrong JSON/TOML type for a string setting is not checked (`_coerce`
    converts only bools, sizes, ints and floats): `policy = ["lru"]` dies in CacheConfig with `TypeError:
    unhashable type`, `nats_url = 4222` is accepted and `kvpool worker` then dies with `AttributeError: 'int'
    object has no attribute 'split'`. It should be a ConfigError naming the setting and the type wanted."""
    path = tmp_path / "kvpool.json"
    path.write_text(json.dumps({section: data}))
    with pytest.raises(ConfigError):
        load(cls, file=path, section=section, env={})


@pytest.mark.parametrize("text,section", [("[1, 2]", None), ("5", "cache"), ('{"cache": 5}', "cache"),
                                          ('{"cache": null}', "cache")], ids=["list", "number", "section-int",
                                                                              "section-null"])
def test_config_file_that_is_not_a_table_is_a_config_error(tmp_path: Path, text: str, section: str | None) -> None:
    """Regression: `read_file` does `dict(json.loads(...))` and `load` calls `.items()` on the section: a JSON file
    whose top level is not an object, or whose `cache`/`worker` section is not one, raises TypeError or
    AttributeError (an `[]` file is silently empty) instead of a ConfigError naming the file."""
    path = tmp_path / "kvpool.json"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load(CacheConfig, file=path, section=section, env={})


def test_kvpool_config_file_is_not_silently_ignored_by_the_python_api(tmp_path: Path) -> None:
    """Regression: KVPOOL_CONFIG is read two ways. `kvpool worker` reads its `[worker]`/`[cache]` sections (the
    format of deploy/systemd/worker.toml); `TieredCache()`, `PoolClient()` (embedded) and `Worker()` read the
    same variable's top level only (`load` without `section`), so pointed at that very file they silently
    run on defaults (1 GiB of DRAM instead of the file's 64 GiB). Either form should be honoured by every
    reader, or the mismatch refused with a ConfigError."""
    shipped = REPO / "deploy" / "systemd" / "worker.toml"
    try:
        cfg = load(CacheConfig, env={"KVPOOL_CONFIG": str(shipped)})
    except ConfigError:
        return
    assert cfg.dram_bytes == 64 << 30 and cfg.ssd_path == "/var/lib/kvpool/ssd", \
        f"KVPOOL_CONFIG={shipped} ignored by CacheConfig: dram_bytes={cfg.dram_bytes}, ssd_path={cfg.ssd_path}"


def test_flat_kvpool_config_is_not_silently_ignored_by_kvpool_worker(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (the other half of the above): a flat KVPOOL_CONFIG file (`dram_bytes = "64MiB"` at the top level,
    which `TieredCache()` honours) is silently ignored by `kvpool worker`, which reads only its `[cache]`
    section: the worker starts with 1 GiB."""
    from kvpool.core import cli, server

    flat = tmp_path / "kvpool.toml"
    flat.write_text('dram_bytes = "64MiB"\nport = 0\n')
    monkeypatch.setenv("KVPOOL_CONFIG", str(flat))
    assert load(CacheConfig).dram_bytes == 64 << 20  # the Python API reads it
    seen: dict[str, object] = {}
    monkeypatch.setattr(server, "Worker", lambda w, c: seen.update(worker=w, cache=c))
    try:
        cli._build_worker(cli.build_parser().parse_args(["worker"]))
    except ConfigError:
        return
    cache = seen["cache"]
    assert isinstance(cache, CacheConfig) and cache.dram_bytes == 64 << 20, \
        f"kvpool worker ignored KVPOOL_CONFIG={flat}: dram_bytes={getattr(cache, 'dram_bytes', None)}"


def test_misspelt_key_in_config_section_is_not_silently_ignored(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Regression: a key a section does not know (`dram_byts = "64MiB"` under `[cache]`) is dropped without a word
    (`load` filters the file's keys by field name, config.py), so the worker runs on the default it was meant to
    override; unknown keyword overrides are an error, and kvtest configs refuse unknown keys for this very
    reason. A misspelt key should be a ConfigError (or at least a logged warning naming it)."""
    path = tmp_path / "worker.toml"
    path.write_text('[cache]\ndram_byts = "64MiB"\n[worker]\nmetrics_prot = 9464\n')
    for cls, section, typo in ((CacheConfig, "cache", "dram_byts"), (WorkerConfig, "worker", "metrics_prot")):
        caplog.clear()
        try:
            load(cls, file=path, section=section, env={})
        except ConfigError as e:
            assert typo in str(e)
            continue
        assert typo in caplog.text, f"[{section}] {typo} silently ignored"


# ----- worker settings ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--port", "70000"], ["--port", "0", "--metrics-port", "70000"]],
                         ids=["port", "metrics-port"])
def test_worker_port_out_of_range_is_a_clean_error(tmp_path: Path, flags: list[str]) -> None:
    """Regression: WorkerConfig does not check `port` / `metrics_port` are 0-65535; `kvpool worker --port 70000` (or
    `--metrics-port 70000`, `KVPOOL_PORT=70000`) dies with `OverflowError: bind(): port must be 0-65535` and a
    traceback (socket.create_server / prometheus start_http_server; metrics.py catches only OSError), not the
    one-line ConfigError/ListenError of every other bad address."""
    _clean_refusal(_kvpool(tmp_path, "worker", *flags, "--dram-bytes", "64MiB", timeout=30),
                   f"kvpool worker {' '.join(flags)}")


def test_member_ttl_shorter_than_heartbeat_is_refused(nats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: `member_ttl_s` at or under `heartbeat_s` (`KVPOOL_MEMBER_TTL_S=1`: "detect dead workers faster")
    is accepted, and the worker fences its reads at every heartbeat (`fence_after(member_ttl_s - heartbeat_s)`,
    a time in the past): every get is a miss, right after the put, with only a misleading "no heartbeat got
    through for 0.0 s" warning. It should be a ConfigError at start (member_ttl_s > heartbeat_s, with room)."""
    from kvpool.core import PoolClient
    from kvpool.core.server import Worker

    monkeypatch.setenv("KVPOOL_STATE_DIR", str(tmp_path / "state"))
    try:
        cfg = load(WorkerConfig, env={"KVPOOL_MEMBER_TTL_S": "1"}, port=0, nats_url=nats.url)
        worker = Worker(cfg, CacheConfig(dram_bytes=64 << 20)).start()
    except ConfigError:
        return
    try:
        with PoolClient(mode="local", worker=worker.unix_path) as client:
            client.put("k", b"x" * 100)
            time.sleep(0.2)
            assert client.get("k") == b"x" * 100, "a worker with member_ttl_s < heartbeat_s serves misses"
    finally:
        worker.stop()


# ----- command line -------------------------------------------------------------------------------------------

def test_status_watch_negative_interval_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: `kvpool status --watch --interval -1` (or `nan`) is accepted by the parser, draws one table and
    then dies in time.sleep with `ValueError: sleep length must be non-negative` (a traceback: not a
    KVPoolError). The parser should refuse it (exit status 2, naming --interval)."""
    from kvpool.core import cli, client
    from kvpool.core.memory_backend import MemoryBackend

    real = client.PoolClient
    monkeypatch.setattr(client, "PoolClient", lambda **kw: real(backend=MemoryBackend()))
    try:
        rc = cli.main(["status", "--watch", "--interval", "-1", "--count", "2"])
    except SystemExit as e:
        rc = e.code
    except ValueError as e:
        pytest.fail(f"--interval -1 ended in {type(e).__name__}: {e}")
    assert rc == 2


def test_status_watch_negative_count_is_a_usage_error() -> None:
    """`kvpool status --watch --count -1` drew one table and stopped, as if asked for one."""
    from kvpool.core import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["status", "--watch", "--count", "-1"])
    assert e.value.code == 2


def test_abbreviated_token_flag_is_kept_out_of_the_command_line() -> None:
    """Regression: argparse accepts abbreviations (`--tok SECRET` is `--token SECRET`), but `_secrets_out_of_sight`
    matches only the exact `--token`/`--nats-url`, so an abbreviated secret stays in the re-exec'd command line,
    readable by every user in /proc/PID/cmdline, against the README's promise that a `--token` given anyway is
    moved into the environment. The parser should not take abbreviations (allow_abbrev=False), or the hiding
    should match them."""
    from kvpool.core import cli

    for argv in (["worker", "--tok", "s3cret-token"], ["status", "--toke=s3cret-token"],
                 ["worker", "--nats-u", "nats://u:s3cret-token@10.0.0.1:4222"]):
        try:
            cli.build_parser().parse_args(argv)
        except SystemExit:
            continue  # abbreviation refused: fine
        rest, _ = cli._secrets_out_of_sight(argv)
        assert not any("s3cret-token" in a for a in rest), f"{argv}: the secret stays on the command line: {rest}"


def test_events_json_lines_keep_binary_keys() -> None:
    """Regression: `kvpool events` (no --zmq) prints each key with `key.decode(errors="replace")`: a binary key (a
    `bytes` key from the Python API) comes out as U+FFFD runs, so distinct keys print identically and no
    consumer can match them back, where the batch on NATS carries it as `{"hex": ...}`. The JSON line should
    keep the key recoverable (the batch's own form)."""
    from kvpool.core.events import BlockEvent, EventBatch, key_from_json
    from kvpool.core.events_cli import _line

    keys = [b"\xff\x01block", b"\xfe\x01block"]
    batch = EventBatch("w", "n", "b", 0, 0.0, 0, [BlockEvent("stored", "dram", "", k) for k in keys])
    printed = [e[3] for e in json.loads(_line(batch))["events"]]
    assert [key_from_json(k) for k in printed] == keys, f"printed keys {printed!r} lost the keys {keys!r}"


# ----- kvtest ------------------------------------------------------------------------------------------------

def test_kvtest_csv_to_an_unwritable_path_fails_cleanly(tmp_path: Path) -> None:
    """Regression: `kvpool bench kvtest --csv DIR/missing/x.csv` runs the whole benchmark, then dies with a
    FileNotFoundError traceback when it appends the rows (kvtest_csv.write, called before the results are
    emitted), so the run's figures are lost too. An unwritable --csv should be refused before the run (or the
    results printed and the write failure reported as one line)."""
    ran = _kvpool(tmp_path, "bench", "kvtest", "--data-sizes", "64KiB", "--ops", "1", "--test-mode", "set_local",
                  "--csv", str(tmp_path / "missing" / "x.csv"))
    _clean_refusal(ran, "kvpool bench kvtest --csv <unwritable>")
