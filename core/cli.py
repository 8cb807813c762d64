"""The `kvpool` command line: bench, worker, up, status (--watch), events, streams, fastdeploy, mooncake-shim."""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from typing import Any, cast

from .registry import Subparsers, add_command

__all__ = ["COMMANDS", "EXIT_ERROR", "PARENT_ENV", "cmd_worker", "cmd_up", "cmd_status", "build_parser", "main"]

log = logging.getLogger("kvpool.cli")

PARENT_ENV = "KVPOOL_PARENT_PID"
"""A `kvpool worker` started with this set to its parent's pid stops once that process is gone (a
bench or test process that was killed never leaves a worker, and its shared memory, behind)."""

COMMANDS: dict[str, str] = {
    "bench": "kvpool.core.bench",
    "events": "kvpool.core.events_cli",
    "streams": "kvpool.streams.cli",
    "fastdeploy": "kvpool.backends.fastdeploy_patch",
    "mooncake-shim": "kvpool.backends.mooncake_shim",
}
"""Subcommands by module path (`registry`): each module's `add_parser(subparsers)` adds its own. The
faces' modules are named here as data only, imported when the parser is built: core imports no face,
and a face that cannot be imported is listed as unavailable instead of breaking every command."""


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML/JSON file with [worker] and [cache] sections")
    p.add_argument("--host", help="bind address (default 127.0.0.1; others need --token)")
    p.add_argument("--port", type=int, help="TCP port (default 7461; 0 = any free port)")
    p.add_argument("--token", help="shared secret clients must prove they hold (or KVPOOL_TOKEN; on loopback "
                                   "the default is the token file made at first start, <state dir>/token)")
    p.add_argument("--no-auth", action="store_true", default=None,
                   help="loopback only: no token (any local user may use the pool); or KVPOOL_NO_AUTH=1")
    p.add_argument("--tls-cert", help="serve TCP over TLS with this certificate (PEM; with --tls-key; or "
                                      "KVPOOL_TLS_CERT): clients then need KVPOOL_TLS_CA, the CA to verify it against")
    p.add_argument("--tls-key", help="the TLS certificate's private key (PEM; or KVPOOL_TLS_KEY)")
    p.add_argument("--tenants", dest="tenants_file", metavar="FILE",
                   help="tenant tokens, each bound to the key namespace '<tenant>/' with a quota: a 0600 JSON/TOML "
                        "file {name: {token, quota_bytes}} (or KVPOOL_TENANTS_FILE)")
    p.add_argument("--worker-id", help="this worker's id in the cluster (default: kept with its SSD tier or state)")
    p.add_argument("--advertise-host", help="the address other machines reach this worker at (default --host; "
                                            "required with a wildcard --host in a cluster)")
    p.add_argument("--node-id", help="this machine's id for same-node shared memory (default: hostname, boot id "
                                     "and network namespace)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--check-puts", choices=["commit", "first_read"],
                   help="hash a same-node put's blocks before committing them (commit, the default) or at "
                        "their first read (first_read; or KVPOOL_CHECK_PUTS)")
    p.add_argument("--dram-bytes", help="DRAM arena size, e.g. 4GiB")
    p.add_argument("--ssd-path", help="LMDB directory of the SSD tier (none by default)")
    p.add_argument("--ssd-map-size", help="LMDB map size, e.g. 64GiB")
    p.add_argument("--events", action="store_true", default=None,
                   help="publish block events on NATS kvpool.events.<worker> (see kvpool events)")
    p.add_argument("--events-zmq", metavar="ENDPOINT", help="publish block events in vLLM's ZMQ format, bound here")


def _cluster_args(p: argparse.ArgumentParser) -> None:
    """The options that name a NATS to register at: `kvpool worker`'s only (`kvpool up` registers its
    worker at the NATS it starts, so it has none, and refuses them as any unknown option)."""
    p.add_argument("--nats-url", help="register in the cluster at this NATS server")
    p.add_argument("--nats-creds", help="file with the NATS nkey seed or password to register with (or "
                                        "KVPOOL_NATS_CREDS; default: the worker credentials of `kvpool up` in "
                                        "<state dir>/nats)")


def _build_worker(args: argparse.Namespace) -> Any:
    from .config import CacheConfig, WorkerConfig, load
    from .server import Worker

    def pick(names: list[str]) -> dict[str, Any]:  # the options given on the command line
        return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}

    wcfg = load(WorkerConfig, file=args.config, section="worker",
                **pick(["host", "port", "token", "no_auth", "tls_cert", "tls_key", "tenants_file", "nats_url",
                        "nats_creds", "metrics_port", "worker_id", "advertise_host", "node_id", "events",
                        "events_zmq", "check_puts"]))
    ccfg = load(CacheConfig, file=args.config, section="cache", **pick(["dram_bytes", "ssd_path", "ssd_map_size"]))
    return Worker(wcfg, ccfg)


def _stop_signal() -> threading.Event:
    """An event set by SIGINT, SIGTERM or SIGHUP (the terminal or ssh session went away): each stops
    as cleanly as the others (DRAM flushed to SSD, the arena unlinked). Installed before serving, so no
    early signal is lost."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: done.set())
    return done


def _wait_for_stop(done: threading.Event, parent: int | None = None) -> None:
    """Block until `done`, waking twice a second: Python runs signal handlers in the main thread only,
    and a signal the kernel delivers to another thread does not interrupt an unbounded wait, so a
    SIGTERM could otherwise go unnoticed for ever. With `parent`, also until this process's parent is
    no longer that process (it died, even by kill -9, and this one was handed to another)."""
    while not done.wait(0.5):
        if parent is not None and os.getppid() != parent:
            log.warning("the process that started this worker (pid %d) is gone: stopping", parent)
            return


def cmd_worker(args: argparse.Namespace) -> int:
    faulthandler.enable()  # a worker that crashes or is sent SIGABRT leaves every thread's stack
    done = _stop_signal()
    worker = _build_worker(args).start()
    metrics = "" if worker.metrics_port is None else f", metrics port {worker.metrics_port}"
    print(f"kvpool worker {worker.worker_id}: tcp {worker.address}, same-node {worker.unix_path}{metrics}", flush=True)
    parent = os.environ.get(PARENT_ENV)
    _wait_for_stop(done, int(parent) if parent and parent.isdigit() else None)
    worker.stop()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from .nats_creds import authorization, creds_dir, creds_path, ensure_creds
    from .nats_server import NatsServer

    done = _stop_signal()
    where = creds_dir()
    if args.nats_no_auth:
        auth, secured = None, "anyone who reaches it may join and write membership (--nats-no-auth)"
    else:
        auth = authorization(ensure_creds(where))
        secured = f"a user per role (nkeys, or passwords in files of older versions) in {where} (0600)"
        args.nats_creds = str(creds_path("worker", where))
    tls = (args.nats_tls_cert, args.nats_tls_key) if args.nats_tls_cert else None
    if tls:  # our own worker trusts the certificate (itself the CA, when self-signed) unless told a CA
        os.environ.setdefault("KVPOOL_NATS_TLS_CA", tls[0])
        secured += f"; TLS: clients set KVPOOL_NATS_TLS_CA={os.environ['KVPOOL_NATS_TLS_CA']}"
    nats = NatsServer(where, port=args.nats_port, host=args.nats_host, authorization=auth, tls=tls).start()
    args.nats_url = nats.url
    try:
        worker = _build_worker(args).start()
    except BaseException:
        nats.stop()
        raise
    tls_note = ("\n  worker TLS:       clients verify it with KVPOOL_TLS_CA=<the CA that signed "
                f"{worker.config.tls_cert}>" if worker.config.tls_cert else "")
    access = secured if args.nats_no_auth else f"""{secured}
                    processes of this user find them there; elsewhere, hand over only the role needed:
                    KVPOOL_NATS_CREDS={creds_path("client", where)}  (clients: read membership, use streams)
                    {creds_path("worker", where)} (workers), {creds_path("admin", where)} (create streams)"""
    print(f"""kvpool is up: NATS {nats.url}, worker {worker.worker_id} at {worker.address}

  NATS access:      {access}
  Python clients:   KVPOOL_NATS_URL={nats.url}   (cluster mode){tls_note}
  same-node only:   KVPOOL_MODE=local KVPOOL_WORKER={worker.unix_path}
  SGLang:           --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
                    '{{"backend_name":"kvpool","module_path":"kvpool.backends.sglang","class_name":"KVPoolHiCacheStorage","interface_v1":1,"nats_url":"{nats.url}"}}'
  vLLM:             --kv-transfer-config \\
                    '{{"kv_connector":"KVPoolConnector","kv_connector_module_path":"kvpool.backends.vllm","kv_role":"kv_both","kv_connector_extra_config":{{"nats_url":"{nats.url}"}}}}'
  Mooncake API:     PYTHONPATH=$(kvpool mooncake-shim) with master_server_addr {nats.url}
  status:           kvpool status --nats-url {nats.url}

Ctrl-C stops both.""", flush=True)

    try:
        _wait_for_stop(done)
        worker.stop()
    finally:
        nats.stop()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .client import PoolClient
    from .nats_creds import redacted_url

    if args.nats_creds:
        os.environ["KVPOOL_NATS_CREDS"] = args.nats_creds  # read by every NATS connection this command makes

    with PoolClient(mode="cluster", nats_url=args.nats_url, token=args.token, tls_ca=args.tls_ca) as client:
        # membership arrives over NATS just after connecting, and a first look may find none yet (the
        # multi-host test's `kvpool status` printed {} in one CI run of three): a snapshot waits for it
        client.wait_for_members(bool, 3.0)
        if args.watch:
            from .status_watch import watch

            # (sys.stdout as it is now: watch's default is the one of when it was imported)
            return watch(client, redacted_url(args.nats_url), args.interval, args.count, sys.stdout)
        workers = client.stats().workers
    if args.json:
        print(json.dumps({w: s.as_dict() for w, s in workers.items()}))
        return 0
    if not workers:
        print(f"no live workers at {redacted_url(args.nats_url)}")
        return 1
    ww = max(10, *(len(w) for w in workers))  # columns as wide as their longest entry (a node id may be long)
    wn = max(16, *(len(s.info.node_id or "?") for s in workers.values()))
    wa = max(22, *(len(s.info.tcp or "?") for s in workers.values()))
    print(f"{'worker':<{ww}} {'node':<{wn}} {'address':<{wa}} {'dram used/cap':>22} {'ssd bytes':>12} {'hit rate':>9}")
    for w, s in sorted(workers.items()):
        c = s.cache
        hits = c.hits_dram + c.hits_ssd + c.hits_device if c is not None else 0
        total = hits + c.misses if c is not None else 0
        rate = f"{hits / total:.1%}" if total else "-"
        i = s.info
        fill = f"{i.dram_bytes >> 20}/{i.dram_capacity >> 20} MiB"
        print(f"{w:<{ww}} {i.node_id or '?':<{wn}} {i.tcp or '?':<{wa}} {fill:>22} {i.ssd_bytes:>12} {rate:>9}")
    return 0


class _Parser(argparse.ArgumentParser):
    """No abbreviated options (`--tok` for `--token`): each option is spelt whole, so the hiding of
    secret-bearing ones (`_secrets_out_of_sight`) sees every one. Subcommands' parsers are of this class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def _positive_seconds(text: str) -> float:
    """An argparse type: seconds above 0 (not NaN)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: want a number of seconds above 0")
    return value


def _tables(text: str) -> int:
    """An argparse type: a count of tables, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want a whole number, 0 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvpool", description="kvpool: a shared, tiered KV-cache pool")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = cast(Subparsers, parser.add_subparsers(dest="command", required=True))  # (of _Parser: see its doc)
    w = sub.add_parser("worker", help="serve this node's tiered cache to local and remote clients")
    _worker_args(w)
    _cluster_args(w)
    w.set_defaults(func=cmd_worker)
    u = sub.add_parser("up", help="start nats-server and one worker: the single-machine deployment")
    _worker_args(u)
    u.add_argument("--nats-port", type=int, default=4222)
    u.add_argument("--nats-host", default="127.0.0.1", help="NATS listen address (127.0.0.1)")
    u.add_argument("--nats-no-auth", action="store_true",
                   help="run NATS without users (anyone who reaches it joins the cluster): trusted networks only")
    u.add_argument("--nats-tls-cert", help="serve NATS over TLS with this certificate (PEM; with --nats-tls-key)")
    u.add_argument("--nats-tls-key", help="the certificate's private key (PEM)")
    u.set_defaults(func=cmd_up)
    s = sub.add_parser("status", help="members, capacities, fill and hit rates of the cluster")
    s.add_argument("--nats-url", default=os.environ.get("KVPOOL_NATS_URL", "nats://127.0.0.1:4222"))
    s.add_argument("--token", default=None)
    s.add_argument("--tls-ca", help="CA file to verify TLS workers against (or KVPOOL_TLS_CA)")
    s.add_argument("--nats-creds", help="NATS credentials file: nkey seed or user/password (or KVPOOL_NATS_CREDS; "
                                        "default: in the state dir)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", action="store_true", help="live rates per worker, redrawn every --interval seconds")
    s.add_argument("--interval", type=_positive_seconds, default=2.0, help="seconds between redraws with --watch (2)")
    s.add_argument("--count", type=_tables, default=0,
                   help="with --watch: stop after this many tables (0 = until Ctrl-C)")
    s.set_defaults(func=cmd_status)
    for name, module in COMMANDS.items():
        add_command(sub, name, module)
    return parser


EXIT_ERROR = 2
"""The exit status of a command that failed with a KVPoolError: 2, as argparse's usage errors and the
commands that report their own (`kvpool bench`, `kvpool events`)."""


_SECRET_FLAGS = {"--token": "KVPOOL_TOKEN", "--nats-url": "KVPOOL_NATS_URL"}
"""Options that may carry a secret (a token; a NATS URL with a user and password), and the environment
variable each has instead."""

_OWN_NATS = frozenset({"up"})
"""Commands that start their own NATS and take no `--nats-url`: one given them is not moved to the
environment (where it would be ignored in silence) but left for the parser to refuse, its password
replaced by *** (the parser's error repeats it)."""


def _secrets_out_of_sight(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """`argv` without the secret-bearing options, and the environment that carries them instead: any user
    of the machine can read a process's command line (/proc/PID/cmdline), only its own user its
    environment. A NATS URL without credentials stays where it is."""
    from .nats_creds import redacted_url

    out: list[str] = []
    env: dict[str, str] = {}
    command: str | None = None  # the first word that is neither an option nor a secret option's value
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in _SECRET_FLAGS and (eq or i + 1 < len(argv)):
            if not eq:
                i += 1
                value = argv[i]
            if command is None or (flag == "--nats-url" and command in _OWN_NATS):
                # (no command takes it there: left, its secret hidden, for the parser to refuse)
                out += [flag, redacted_url(value) if flag == "--nats-url" else "***"]
            elif flag != "--nats-url" or "@" in value:
                env[_SECRET_FLAGS[flag]] = value
            else:
                out += [flag, value]
        else:
            if command is None and not argv[i].startswith("-"):
                command = argv[i]  # (the top level's own options take no value)
            out.append(argv[i])
        i += 1
    return out, env


def main(argv: list[str] | None = None) -> int:
    """Run one command; a KVPoolError (a refused token, an unreachable pool, a bad option value) is one
    line on stderr, `kvpool <command>: <ErrorType>: <message>`, and EXIT_ERROR; with -v its traceback
    is logged too. Anything else is a bug and keeps its traceback. A command line that carries a secret
    (`--token`, a `--nats-url` with a password) runs again at once with the secret in its environment
    instead, out of other users' sight."""
    from .errors import KVPoolError

    if argv is None:
        argv, hidden = _secrets_out_of_sight(sys.argv[1:])
        if hidden:
            os.execve(sys.executable, [sys.executable, "-m", "kvpool.core.cli", *argv], {**os.environ, **hidden})
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except KVPoolError as e:
        log.debug("kvpool %s failed", args.command, exc_info=True)
        print(f"kvpool {args.command}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
