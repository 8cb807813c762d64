"""Options of `kvpool bench cache`: built-in defaults < kvtest-like `--config FILE.json` files < flags.

The files use openYuanrong kvtest's key names so kvtest configs can be brought across as they are: a
test config (`test_mode`, `key_pool_size`, `hit_rate`, ...) and an instance config (`instance_id`,
`listen_port`, `rocksdb_store_dir`, `remote_worker`: see `kvtest_instance`), in one file or several
(`--config instance0.json --config cache.json`; a later file's keys win). Keys kvtest has but this
tool does not implement, and keys neither knows, are errors that name them: a silently ignored key
would make the run measure something other than what the files say.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from ..config import parse_size
from ..errors import ConfigError
from .kvtest_instance import DEFAULT_NATS, Instance

__all__ = ["ROLES", "MIN_BLOCK", "CacheOptions", "from_kvtest_files", "read_kvtest", "from_kvtest", "add_arguments",
           "resolve"]

ROLES = ("both", "writer", "reader")
MIN_BLOCK = 16
"""The smallest block a cache or kvtest run puts, in bytes."""


@dataclasses.dataclass
class CacheOptions:
    role: str = "both"
    """writer: get-or-create and publish the key window; reader: only get and verify the writer's
    keys; both: the writer's run, then a second client reads back every key of the window."""
    key_pool_size: int = 512
    hit_rate: float = 0.8
    inference_delay_ms: float = 1.0
    block_size: int = 1 << 20
    """bytes per block"""
    batch_size: int = 1
    """keys per get and per put call"""
    duration: float | None = None
    """seconds; default 20 (8 with --quick) unless `ops` is set"""
    ops: int | None = None
    """get-or-create calls (reader: get calls) to run instead of a duration"""
    workers: int = 0
    """start this many local `kvpool worker` processes and a nats-server and run against them"""
    cluster: str | None = None
    """NATS URL of an existing cluster (`kvpool up`) to run against"""
    namespace: str = "kvpool-bench"
    """key prefix; a reader must use its writer's namespace"""
    dram_bytes: int | None = None
    """pool DRAM (per worker with --workers); default: room for twice the key pool"""
    ssd: bool = False
    """give the embedded pool / the local workers an SSD tier in a temp dir"""
    data_sizes: list[int] | None = None
    """several block sizes in bytes: key number n's block is `data_sizes[n % len]` (default: block_size)"""
    threads: int = 1
    """threads issuing calls at once (kvtest's num_threads), each with its own client where the pool has several"""
    target_qps: float = 0.0
    """calls per second over all threads (get-or-create; reader: get); 0 = as fast as they go"""
    instance_id: int | None = None
    """kvtest multi-node mode: this run is instance N (worker kvtest-N; see kvtest_instance)"""
    listen_port: int | None = None
    store_dir: str | None = None
    remote_worker: str | None = None
    csv: str | None = None
    """also write kvtest's CSV rows to this file"""

    @property
    def sizes(self) -> list[int]:
        return self.data_sizes or [self.block_size]

    @property
    def instance(self) -> Instance | None:
        """The kvtest instance this run is, if the config named one."""
        if self.instance_id is None:
            return None
        return Instance(self.instance_id, self.listen_port or 0, self.store_dir, self.remote_worker,
                        self.cluster or DEFAULT_NATS)

    def __post_init__(self) -> None:
        if self.data_sizes and len(self.data_sizes) == 1:  # one size is the block size
            self.block_size, self.data_sizes = self.data_sizes[0], None
        instance_keys = [n for n in ("listen_port", "store_dir", "remote_worker") if getattr(self, n) is not None]
        checks = [
            (self.role in ROLES, f"role {self.role!r} is not one of {', '.join(ROLES)}"),
            (0.0 <= self.hit_rate <= 1.0, f"hit rate {self.hit_rate} is not within 0..1"),
            (self.key_pool_size >= 1, f"key pool size {self.key_pool_size} must be >= 1"),
            (self.inference_delay_ms >= 0, f"inference delay {self.inference_delay_ms} ms must be >= 0"),
            (self.block_size >= MIN_BLOCK, f"block size {self.block_size} bytes must be >= {MIN_BLOCK}"),
            (self.batch_size >= 1, f"batch size {self.batch_size} must be >= 1"),
            (self.workers >= 0, f"workers {self.workers} must be >= 0"),
            (not (self.workers and self.cluster), "--workers and --cluster exclude each other"),
            (self.duration is None or self.ops is None, "give a duration or a number of ops, not both"),
            (self.duration is None or 0 < self.duration < math.inf,
             f"duration {self.duration} s must be a finite number of seconds above 0"),
            (self.ops is None or self.ops >= 1, f"ops {self.ops} must be >= 1"),
            (not (self.cluster and self.instance_id is None and (self.ssd or self.dram_bytes)),
             "--ssd and --dram-bytes size the pool this run starts; an existing --cluster has its own"),
            (self.role == "both" or self.cluster is not None or self.instance_id is not None,
             f"role {self.role} shares blocks with other processes: it needs --cluster nats://... "
             "or a kvtest instance config (instance_id, listen_port, remote_worker)"),
            (self.threads >= 1, f"num_threads {self.threads} must be >= 1"),
            (self.target_qps >= 0, f"target_qps {self.target_qps} must be >= 0 (0 = unlimited)"),
            (not self.data_sizes or all(s >= MIN_BLOCK for s in self.data_sizes),
             f"data_sizes {self.data_sizes}: every size must be >= {MIN_BLOCK} bytes"),
            (self.instance_id is None or self.listen_port is not None,
             f"instance {self.instance_id} needs listen_port (its worker's TCP port)"),
            (self.instance_id is not None or not instance_keys,
             f"{', '.join(instance_keys)} describe a kvtest instance: give instance_id too"),
            (self.instance_id is None or not self.workers, "a kvtest instance config and --workers exclude each other"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.instance_id is not None:
            self.instance  # noqa: B018  (validates the instance's port and remote_worker)


def _sizes(value: Any) -> list[int]:
    sizes = value if isinstance(value, list) else [value]
    if not sizes:
        raise ConfigError("data_sizes is empty; give at least one size")
    return [parse_size(s) for s in sizes]


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"rocksdb_store_dir {value!r} is not a folder path")
    return value


def _test_mode(value: Any) -> str:
    if value == "cache":
        return "both"
    for prefix, role in (("set", "writer"), ("get", "reader")):
        if str(value).startswith(prefix):
            return role
    raise ConfigError(f"test_mode {value!r}: expected cache, set_* (writer) or get_* (reader)")


def _expect(name: str, wanted: Any) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value != wanted:
            raise ConfigError(f"{name} {value!r}: kvpool bench cache runs kvtest's {name} {wanted!r}")
    return check


# kvtest key -> (option, converter); option None: a key that only has to agree with this tool
_KVTEST: dict[str, tuple[str | None, Callable[[Any], Any]]] = {
    "mode": (None, _expect("mode", "cache")),
    "pipeline": (None, _expect("pipeline", ["cacheGetOrCreate"])),
    "test_mode": ("role", _test_mode),
    "role": ("role", str),
    "key_pool_size": ("key_pool_size", int),
    "target_hit_rate": ("hit_rate", float),
    "hit_rate": ("hit_rate", float),
    "inference_delay_ms": ("inference_delay_ms", float),
    "data_sizes": ("data_sizes", _sizes),
    "block_size": ("block_size", parse_size),
    "batch_keys_count": ("batch_size", int),
    "batch_size": ("batch_size", int),
    "duration": ("duration", float),
    "ops": ("ops", int),
    "target_qps": ("target_qps", float),
    "num_threads": ("threads", int),
    "instance_id": ("instance_id", int),
    "listen_port": ("listen_port", int),
    "rocksdb_store_dir": ("store_dir", _path),
    "remote_worker": ("remote_worker", str),
    "nats_url": ("cluster", str),
}
_KVTEST_UNSUPPORTED = ("max_key_pool_size", "set_param")


def from_kvtest_files(paths: list[str]) -> dict[str, Any]:
    """Option values from several kvtest-like files, a later file's keys overriding an earlier's."""
    values: dict[str, Any] = {}
    for path in paths:
        values.update(from_kvtest(path))
    return values


def read_kvtest(path: str) -> dict[str, Any]:
    """The JSON object of a kvtest config file; ConfigError if it is not one."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config {path!r} is not a readable JSON file: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"config {path!r} must hold one JSON object, not {type(cfg).__name__}")
    return cfg


def from_kvtest(path: str, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """Option values from a kvtest-like JSON file (or its object `cfg`, already read); ConfigError names
    unknown or unsupported keys."""
    cfg = read_kvtest(path) if cfg is None else cfg
    unsupported = sorted(k for k in cfg if k in _KVTEST_UNSUPPORTED)
    if unsupported:
        raise ConfigError(f"config {path!r}: kvtest keys not supported by kvpool bench cache: "
                          f"{', '.join(unsupported)}; remove them")
    unknown = sorted(k for k in cfg if k not in _KVTEST)
    if unknown:
        raise ConfigError(f"config {path!r}: unknown keys {', '.join(unknown)}; known: {', '.join(_KVTEST)}")
    values: dict[str, Any] = {}
    for key, value in cfg.items():
        option, convert = _KVTEST[key]
        try:
            converted = convert(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config {path!r}: {key} {value!r} is not valid: {e}") from e
        if option is not None:
            values[option] = converted
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags default to None so that only the ones given override the config file."""
    p.add_argument("--role", choices=ROLES, help="writer | reader | both (default both)")
    p.add_argument("--key-pool-size", type=int, help="keys a get may hit: the window of the latest created (512)")
    p.add_argument("--hit-rate", type=float, help="target fraction of gets that hit (0.8)")
    p.add_argument("--inference-delay-ms", type=float, help="simulated compute per miss (1.0)")
    p.add_argument("--block-size", type=parse_size, help="bytes per block, e.g. 64KiB (1MiB)")
    p.add_argument("--batch-size", type=int, help="keys per get/put call (1)")
    run = p.add_mutually_exclusive_group()
    run.add_argument("--duration", type=float, help="seconds to run (20; 8 with --quick)")
    run.add_argument("--ops", type=int, help="get-or-create calls to run instead of a duration")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, help="start N local workers and a nats-server; run against them")
    where.add_argument("--cluster", metavar="NATS_URL", help="run against an existing cluster")
    p.add_argument("--namespace", help="key prefix shared by a writer and its readers (kvpool-bench)")
    p.add_argument("--dram-bytes", type=parse_size, help="pool DRAM, per worker with --workers (2x the key pool)")
    p.add_argument("--ssd", action="store_true", default=None, help="an SSD tier (temp dir) for the pool")
    p.add_argument("--threads", type=int, help="threads issuing calls at once (1)")
    p.add_argument("--target-qps", type=float, help="calls per second over all threads (0 = unlimited)")
    p.add_argument("--csv", metavar="FILE", help="also write kvtest's CSV rows (timestamp,op,count,...) to FILE")
    p.add_argument("--config", action="append", help="a kvtest-like JSON file (key_pool_size, target_hit_rate, "
                   "instance_id, listen_port, remote_worker, ...); repeat it for a test config beside an "
                   "instance config")


def resolve(args: argparse.Namespace) -> CacheOptions:
    """CacheOptions from defaults < `--config` < flags given on the command line."""
    fields = {f.name for f in dataclasses.fields(CacheOptions)}
    values = from_kvtest_files(args.config) if getattr(args, "config", None) else {}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    for one, other in (("ops", "duration"), ("duration", "ops")):
        if one in given:  # a flag replaces the file's way of bounding the run
            values.pop(other, None)
    values.update(given)
    if values.get("duration") is None and values.get("ops") is None:
        values["duration"] = 8.0 if args.quick else 20.0
    return CacheOptions(**values)
