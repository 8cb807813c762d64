"""Configuration: one dataclass per component, loaded from defaults, a TOML/JSON file, `KVPOOL_*`
environment variables and keyword overrides, in that order of precedence (last wins).

Environment names are the field names upper-cased under a component prefix, e.g. `KVPOOL_DRAM_BYTES`
for `CacheConfig.dram_bytes`. Sizes accept suffixes: `512MiB`, `4GiB`, `1.5GB`.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, get_type_hints

from .errors import ConfigError
from .policies import EVICTION_POLICY

__all__ = ["parse_size", "default_state_dir", "default_node_id", "read_file", "load", "section", "SECTIONS",
           "CacheConfig", "WorkerConfig"]

_MOST_SECONDS = 1e9
"""The longest timeout, heartbeat or TTL a worker takes (about 31 years): past 2**63 s a socket's timeout
cannot be set, and the worker would close every connection."""

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from .nats_creds import NatsCreds

C = TypeVar("C", bound="DataclassInstance")

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
"""A device tier's `device`: "auto", "cpu" (tests) or a CUDA device ("cuda", "cuda:N")."""

WORKER_ID = re.compile(r"[-_=A-Za-z0-9]{1,128}(\.[-_=A-Za-z0-9]{1,128}){0,7}")
"""A worker id: a key of NATS's member bucket (dot-separated tokens of `-_=` and letters and digits;
kvpool's own are hex)."""

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: str | int | float) -> int:
    """Bytes from an int (or a whole float: `4e9`) or a string like `64KiB`, `1.5GB`, `1048576`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # (`dram_bytes = 4e9` in a file)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"size {value!r} is not a number of bytes with an optional unit (KiB, MiB, GiB, GB)")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"size {value!r} is not a number of bytes with an optional unit (KiB, MiB, GiB, GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_state_dir() -> Path:
    """Where kvpool keeps its service state (token, NATS credentials, sockets, worker ids; an SSD tier only
    where `ssd_path` says so): $KVPOOL_STATE_DIR or ~/.local/state/kvpool."""
    env = os.environ.get("KVPOOL_STATE_DIR")
    return Path(env) if env else Path.home() / ".local" / "state" / "kvpool"


def default_node_id() -> str:
    """This machine's identity for same-node shared memory: the hostname, the kernel's boot id and the
    network namespace. A hostname alone is shared by cloned machines and by every network namespace
    (container) of one kernel; processes agree on all three only when they can share /dev/shm and
    reach each other's Unix sockets."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8])
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:  # not Linux: the hostname is all there is
        pass
    return "/".join(parts)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(name: str, kind: Any, value: Any) -> Any:
    """`value` (from a file, the environment or a keyword) as field `name` of type `kind` wants it; a
    ConfigError naming the setting for a value of another kind (a boolean that is no boolean word, a
    list where a string belongs)."""
    if value is None:
        return None
    text = str(kind)
    why = ""
    try:
        if kind is bool or text == "bool":
            word = str(value).strip().lower() if isinstance(value, (str, int)) else None
            if word in _TRUE or word in _FALSE:
                return word in _TRUE
            why = f"not a boolean (one of {', '.join(_TRUE)} or {', '.join(_FALSE)})"
        elif name.endswith("_bytes") or name.endswith("_size"):
            return parse_size(value)
        elif kind is int or text in ("int", "int | None"):
            if isinstance(value, (bool, float)) or not isinstance(value, (int, str)):
                why = "not a whole number"
            else:
                return int(value)
        elif kind is float or text in ("float", "float | None"):
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                why = "not a number"
            else:
                return float(value)
        elif (kind is str or text in ("str", "str | None")) and not isinstance(value, str):
            why = f"a {type(value).__name__}, not a string"
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config {name}={value!r}: {e}") from e
    if why:
        raise ConfigError(f"config {name}={value!r}: {why}")
    return value


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's top-level table (TOML by extension `.toml`, JSON otherwise)."""
    p = Path(path)
    try:
        if p.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib

                return tomllib.loads(p.read_text())
            # tomllib came with 3.11: on 3.10, say so (as the ConfigError below), not with an ImportError
            raise ConfigError("TOML needs Python 3.11 or later; use JSON")
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read config file {p}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} holds a JSON {type(data).__name__}, not an object of settings")
    return data


SECTIONS: dict[str, type[Any]] = {}
"""The config classes by their section of a config file (`[cache]`, `[worker]`, `[client]`): `section`."""


def section(name: str) -> Callable[[type[C]], type[C]]:
    """Class decorator: the settings of the class may sit in the file's table `name`, or at its top
    level (a flat file, for any class); see `load`."""
    def register(cls: type[C]) -> type[C]:
        SECTIONS[name] = cls
        return cls
    return register


def _file_values(cls: type[Any], path: str | os.PathLike[str], section: str | None) -> dict[str, Any]:
    """`cls`'s settings in a config file: its top-level settings overlaid by those of its table
    `section` (default: the class's own). A name no config class knows, at the top level or in a known
    table, is a ConfigError naming it (a misspelt setting is never silently dropped)."""
    data = read_file(path)
    names = {f.name for f in dataclasses.fields(cls)}
    section = section or next((n for n, c in SECTIONS.items() if c is cls), None)
    known = set().union(*({f.name for f in dataclasses.fields(c)} for c in SECTIONS.values()))
    tables = {k for k, v in data.items() if isinstance(v, dict)}  # (a name that is also a setting: a setting)
    stray = sorted(k for k in data if k not in ({*SECTIONS, section} if k in tables else known | names))
    if stray:
        raise ConfigError(f"config file {path}: unknown setting(s) or table(s) {stray} at its top level (tables: "
                          f"[{'], ['.join(SECTIONS)}], whose settings may also sit at the top level)")
    values = {k: v for k, v in data.items() if k in names and k not in tables}
    if section and section in data and (section in tables or section not in known):
        table = data[section]
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: [{section}] is a {type(table).__name__}, not a table of settings")
        bad = sorted(set(table) - names)
        if bad:
            raise ConfigError(f"config file {path}: unknown {cls.__name__} setting(s) {bad} in [{section}]; known: "
                              f"{sorted(names)}")
        values.update(table)
    return values


def load(cls: type[C], *, prefix: str = "KVPOOL_", file: str | os.PathLike[str] | None = None,
         section: str | None = None, env: Mapping[str, str] | None = None, **overrides: Any) -> C:
    """Build `cls` from defaults < file < environment < overrides.

    The file (`file`, else `$KVPOOL_CONFIG`) gives the class its top-level settings and those of its
    table (`section`, default the class's: `[cache]`, `[worker]`, `[client]`), the table's winning; a
    setting no config class knows is a ConfigError, as an unknown keyword override is.
    """
    env = os.environ if env is None else env
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    file = file or env.get(prefix + "CONFIG")
    if file:
        values.update(_file_values(cls, file, section))
    for name in names:
        if prefix + name.upper() in env:
            text = env[prefix + name.upper()]
            is_flag = hints[name] is bool or str(hints[name]) == "bool"
            values[name] = "false" if is_flag and not text.strip() else text  # (a variable set empty: off)
    bad = set(overrides) - names
    if bad:
        raise ConfigError(f"unknown {cls.__name__} option(s) {sorted(bad)}; known: {sorted(names)}")
    values.update(overrides)
    return cls(**{k: _coerce(k, hints[k], v) for k, v in values.items()})


@section("cache")
@dataclasses.dataclass
class CacheConfig:
    """The TieredCache: tier sizes in bytes, paths, watermarks and policy."""

    dram_bytes: int = 1 << 30
    """Size of the shared-memory arena."""
    dram_slab_size: int = 16 << 20
    """Slab size; also the largest block the DRAM tier holds."""
    dram_name: str | None = None
    """Shared-memory name (without '/'); a unique name is generated when unset."""
    prefault: bool = True
    ssd_path: str | None = None
    """LMDB directory; no SSD tier when unset."""
    ssd_map_size: int = 16 << 30
    ssd_sync: bool = True
    """fsync each committed SSD batch (durable across power loss, not only process crash)."""
    device: str | None = None
    """torch device of the device tier ("cuda", "cuda:0"; "cpu" for tests); "auto" = cuda when present."""
    device_bytes: int = 1 << 30
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    policy: str = "lru"
    verify_dram_reads: bool = False
    """Re-check the checksum on every DRAM read: the embedded cache's, and every read a worker serves (a
    same-node lease, a TCP get); a block whose bytes changed since it was checked (bit rot, a stray
    write) is then a miss, dropped and counted in `checksum_failures`. Off, a block is checked once, at
    its commit or its first read (`WorkerConfig.check_puts`), and a TCP reader checks what arrives."""

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError(f"watermarks low={self.low_watermark} high={self.high_watermark}: "
                              f"need 0 < low < high <= 1")
        if self.dram_slab_size <= 0 or self.dram_slab_size % mmap.PAGESIZE:
            raise ConfigError(f"dram_slab_size {self.dram_slab_size}: a positive multiple of the page size "
                              f"({mmap.PAGESIZE} bytes)", size=self.dram_slab_size)
        if self.dram_bytes < self.dram_slab_size:
            raise ConfigError(f"dram_bytes {self.dram_bytes} is smaller than one slab ({self.dram_slab_size})")
        if self.policy not in EVICTION_POLICY:
            raise ConfigError(f"policy {self.policy!r} is not one of {sorted(EVICTION_POLICY)}")
        name = self.dram_name
        if name is not None and ("/" in name or "\0" in name or name in ("", ".", "..")
                                 or len(name.encode()) > 254):
            raise ConfigError(f"dram_name={name!r}: a shared-memory name is 1 to 254 bytes without '/' or NUL "
                              "(and not '.' or '..')")
        if self.device and not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device={self.device!r}: 'auto', 'cpu', 'cuda' or 'cuda:N' (unset: no device tier)")


@section("worker")
@dataclasses.dataclass
class WorkerConfig:
    """A node worker: where it listens, how it authenticates, where it registers.

    Environment: `KVPOOL_HOST`, `KVPOOL_PORT`, `KVPOOL_TOKEN`, `KVPOOL_NATS_URL`, ... The cache
    it owns is configured by `CacheConfig` from the same sources.
    """

    host: str = "127.0.0.1"
    port: int = 7461
    """TCP port; 0 picks a free one."""
    unix_path: str | None = None
    """Unix socket for same-node clients; default `<state dir>/worker-<port>.sock`."""
    token: str | None = None
    """Shared secret every TCP client proves it holds (challenge-response; it never crosses the wire).
    Required for a non-loopback bind; on loopback, unset, the worker uses the token file
    (`KVPOOL_TOKEN_FILE`, else `<state dir>/token`), made 0600 at first start and found there by
    clients of the same user."""
    no_auth: bool = False
    """`--no-auth` / `KVPOOL_NO_AUTH=1`, loopback binds only: TCP clients need no token, so every
    local user can read, write and clear the pool. For single-user machines. Unix-socket clients are
    still checked (same user or root, by SO_PEERCRED)."""
    tls_cert: str | None = None
    """TLS on the TCP port (`--tls-cert`, `KVPOOL_TLS_CERT`): the worker's certificate (PEM, with any
    intermediates), which clients verify against the CA they are given (`KVPOOL_TLS_CA`); with
    `tls_key`. Block data and the handshake then cross the network encrypted; the token's
    challenge-response runs inside. Unset: clear text. See `kvpool.core.tls`."""
    tls_key: str | None = None
    """The certificate's private key (PEM; `--tls-key`, `KVPOOL_TLS_KEY`)."""
    tenants_file: str | None = None
    """Tenant tokens, each scoped to the key namespace `<name>/` with a quota in bytes (`--tenants`,
    `KVPOOL_TENANTS_FILE`): a 0600 JSON or TOML file `{"<name>": {"token": ..., "quota_bytes": ...}}`;
    see `kvpool.core.tenants`. The pool token keeps full access."""
    poll_us: float = 500.0
    """After answering a same-node client's request of a burst (it came within this many microseconds
    of the answer before), the connection's thread polls for the next one this long before it sleeps
    (`KVPOOL_POLL_US`; 0: never): waking a sleeping thread costs more than copying a 16 KiB block (same-
    node gets of 64 x 16 KiB: 0.39 -> 0.5 of memcpy on 2 cores). Only while that client has the worker
    to itself (a poll holds the GIL from other connections' threads), and at most half the cores at once."""
    check_puts: str = "commit"
    """When the worker hashes the bytes a same-node writer put into its slots (`--check-puts`,
    `KVPOOL_CHECK_PUTS`): "commit", before it commits them (a mismatch is refused: the writer's
    CorruptBlock); "first_read", at each block's first read through the worker instead (a lease, a get, a
    write to SSD; a mismatch is then a miss, counted in `checksum_failures`), as for a handoff's layers.
    Either way no block is served unhashed. The hash re-reads what the writer copied: on a machine
    whose memory bandwidth a copy nearly fills, "first_read" makes puts faster and first reads slower
    (docs/BENCHMARKS.md, run AG), and saves the hash of blocks never read."""
    max_connections: int = 1024
    """Connections served at once (a thread each); further ones are closed at once, with a warning."""
    io_timeout_s: float = 30.0
    """A request not received and answered in full within this many seconds of its first byte (a peer
    that stalls or trickles its request, or does not read the reply) closes the connection and frees
    what it held (slots, leases); a connection may idle between requests for any time."""
    auth_timeout_s: float = 10.0
    """With a token: a TCP connection that has not authenticated within this many seconds of
    connecting is closed, however busy it keeps, so strangers cannot hold the worker's threads."""
    max_unauthenticated: int = 64
    """With a token: TCP connections that have not authenticated yet, at most; a new one closes the
    oldest, so strangers only displace each other and a client with the token (which authenticates
    at once) always gets in."""
    node_id: str | None = None
    """Identifies the machine (clients with the same node id use shared memory); default
    `default_node_id()`: hostname, boot id and network namespace."""
    worker_id: str | None = None
    """Names the worker in the cluster (placement follows it); default: the id kept beside its SSD tier
    (`<ssd_path>/kvpool-worker-id`, else `<state dir>/worker-<port>.id`), made once, so a restart on
    the same state serves its blocks where placement expects them."""
    metrics_port: int | None = None
    """Prometheus metrics port on `host`; none when unset."""
    nats_url: str | None = None
    """Register in the cluster at this NATS server; standalone when unset."""
    nats_creds: str | None = None
    """File with the NATS nkey seed (or user and password) to register with (`KVPOOL_NATS_CREDS`); default the
    worker credentials `kvpool up` keeps in `<state dir>/nats/worker.json`, if any (see
    `kvpool.core.nats_creds`)."""
    heartbeat_s: float = 2.0
    member_ttl_s: float = 10.0
    advertise_host: str | None = None
    """Address other machines use to reach this worker; default `host`. Required with a wildcard bind
    (`0.0.0.0`, `::`) in a cluster."""
    nats_replicas: int = 1
    """JetStream replicas of the member bucket when this worker creates it: 3 on a 3-node NATS cluster,
    so membership survives the loss of one NATS node."""
    events: bool = False
    """Publish the cache's block events (stored, moved, removed) on NATS `kvpool.events.<worker_id>`
    (needs `nats_url`); see `kvpool.core.events`."""
    events_zmq: str | None = None
    """Also publish them in vLLM's KV-event format on a ZMQ PUB socket bound here, e.g.
    `tcp://127.0.0.1:5557` (needs `kvpool[events]`); see `kvpool.core.events_zmq`."""
    events_layout: str = "map"
    """ZMQ events as tagged maps (`map`: current vLLM) or arrays (`array`: older vLLM)."""
    events_block_hash: str = "bytes"
    """ZMQ block hashes as 32 `bytes` or 64-bit `int` (Dynamo)."""
    events_block_tokens: int = 16
    """The engine's tokens per block, as ZMQ events report it."""

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{name}={port}: a TCP port is 0 to 65535 (0: any free one)", size=port, limit=65535)
        for name in ("io_timeout_s", "auth_timeout_s", "heartbeat_s", "member_ttl_s"):
            seconds = getattr(self, name)
            if not (0 < seconds <= _MOST_SECONDS):  # (a socket's timeout takes no more: every connection closed)
                raise ConfigError(f"{name}={seconds}: seconds above 0, at most {_MOST_SECONDS:.0e}")
        for name in ("max_connections", "max_unauthenticated"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: at least 1", size=getattr(self, name), limit=1)
        if not 1 <= self.nats_replicas <= 5:
            raise ConfigError(f"nats_replicas={self.nats_replicas}: JetStream keeps 1 to 5 replicas",
                              size=self.nats_replicas, limit=5)
        if not (self.heartbeat_s > 0 and self.member_ttl_s > 2 * self.heartbeat_s):
            raise ConfigError(f"member_ttl_s={self.member_ttl_s} with heartbeat_s={self.heartbeat_s}: the TTL must "
                              "exceed two heartbeats (a worker's reads stay open member_ttl_s - heartbeat_s after "
                              "each heartbeat; less, and it serves misses between them)")
        if not 0 <= self.poll_us <= 10_000:
            raise ConfigError(f"poll_us={self.poll_us}: from 0 to 10000 microseconds")
        if self.worker_id is not None and not WORKER_ID.fullmatch(self.worker_id):
            raise ConfigError(f"worker_id={self.worker_id!r}: letters, digits and '-_=', in tokens joined by '.' "
                              "(a key of NATS's member bucket)")
        if self.check_puts not in ("commit", "first_read"):
            raise ConfigError(f"check_puts={self.check_puts!r}: 'commit' or 'first_read'")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(f"TLS needs both a certificate and its key (tls_cert={self.tls_cert!r}, "
                              f"tls_key={self.tls_key!r})")

    def nats_credentials(self) -> NatsCreds | None:
        """The credentials in the `nats_creds` file; None when unset (then `nats_connect` uses the URL's,
        or finds the worker's)."""
        from .nats_creds import load_creds

        return load_creds(self.nats_creds) if self.nats_creds else None
