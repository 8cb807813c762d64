"""`kvpool streams create|ls|info|rm|tail|pub`: manage streams and watch or feed them from a shell."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from kvpool.core import InvalidArgument, Subparsers

from .admin import StreamConfig, create_stream, delete_stream, list_streams, stream_info
from .errors import MalformedMessage

_COLUMNS = ("name", "messages", "bytes", "first_seq", "last_seq", "consumers", "retention", "discard")


class _Intermixed(argparse.ArgumentParser):
    """A subcommand whose flags may come between its positionals: argparse takes an optional positional
    (`pub`'s DATA) as absent when a flag follows the one before it, then refuses the DATA after the flag."""

    _inner = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inner:  # (parse_known_intermixed_args parses through this method twice)
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Add the `streams` command (with its subcommands) to the `kvpool` command line."""
    top = subparsers.add_parser("streams", help="publish/subscribe streams of notifications and KV blocks")
    top.add_argument("--nats-url", default=os.environ.get("KVPOOL_NATS_URL", "nats://127.0.0.1:4222"))
    top.add_argument("--nats-creds", help="NATS credentials file: nkey seed or user/password (or KVPOOL_NATS_CREDS; "
                                          "default: in the state dir; `create` and `rm` need the admin's)")
    sub = top.add_subparsers(dest="streams_command", required=True)

    c = sub.add_parser("create", help="create a stream (or update its limits)")
    c.add_argument("name")
    c.add_argument("--max-age-s", type=float, default=0.0, help="drop messages older than this (s; 0 = never)")
    c.add_argument("--max-bytes", type=int, default=0, help="retain at most this many bytes (0 = unlimited)")
    c.add_argument("--max-msgs", type=int, default=0, help="retain at most this many messages (0 = unlimited)")
    c.add_argument("--discard", choices=("old", "new"), default="old",
                   help="when full: drop the oldest, or refuse publishes (backpressure)")
    c.add_argument("--retention", choices=("limits", "interest", "workqueue"), default="limits")
    c.add_argument("--memory", action="store_true", help="keep messages in memory, not on disk")
    c.add_argument("--replicas", type=int, default=1, help="copies on a NATS cluster (3 survives losing a node)")
    c.set_defaults(func=_with_creds(_create))

    ls = sub.add_parser("ls", help="list kvpool streams")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_with_creds(_ls))

    i = sub.add_parser("info", help="messages, bytes, sequences and limits of a stream")
    i.add_argument("name")
    i.set_defaults(func=_with_creds(_info))

    r = sub.add_parser("rm", help="delete a stream and its consumers")
    r.add_argument("name")
    r.set_defaults(func=_with_creds(_rm))

    t = sub.add_parser("tail", help="print messages as they arrive, with payload sizes")
    t.add_argument("name")
    t.add_argument("--start", default="new", help="all, new, last, or a sequence number (default new)")
    t.add_argument("--count", type=int, default=0, help="stop after this many messages (0 = never)")
    t.add_argument("--idle-s", type=float, default=0.0, help="stop after this many idle seconds (0 = never)")
    t.set_defaults(func=_with_creds(_tail))

    p = sub.add_parser("pub", help="publish one message: text, JSON (--json) or a file's bytes (--file)")
    p.__class__ = _Intermixed  # `pub NAME --json DATA` as well as `pub NAME DATA --json`
    p.add_argument("name")
    p.add_argument("data", nargs="?", default=None, help="the message text (default: read stdin)")
    p.add_argument("--json", action="store_true", help="DATA is JSON: publish it as a notification")
    p.add_argument("--file", help="publish this file's bytes (by reference through the pool if large)")
    p.add_argument("--topic", default="msg")
    p.set_defaults(func=_with_creds(_pub))
    return top


def _with_creds(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`command` with `--nats-creds`, if given, for every NATS connection it makes."""
    def run(args: argparse.Namespace) -> int:
        if args.nats_creds:
            os.environ["KVPOOL_NATS_CREDS"] = args.nats_creds
        return command(args)
    return run


def _create(args: argparse.Namespace) -> int:
    cfg = StreamConfig(max_age_s=args.max_age_s, max_bytes=args.max_bytes, max_msgs=args.max_msgs,
                       discard=args.discard, retention=args.retention, memory=args.memory,
                       replicas=args.replicas)
    print(json.dumps(create_stream(args.nats_url, args.name, cfg)))
    return 0


def _ls(args: argparse.Namespace) -> int:
    infos = list_streams(args.nats_url)
    if args.json:
        print(json.dumps(infos))
        return 0
    print(" ".join(f"{c:>12}" for c in _COLUMNS))
    for info in infos:
        print(" ".join(f"{info[c]!s:>12}" for c in _COLUMNS))
    return 0


def _info(args: argparse.Namespace) -> int:
    print(json.dumps(stream_info(args.nats_url, args.name)))
    return 0


def _rm(args: argparse.Namespace) -> int:
    delete_stream(args.nats_url, args.name)
    return 0


def _tail(args: argparse.Namespace) -> int:
    from .consumer import Consumer

    if not 0 <= args.idle_s < math.inf or args.count < 0:
        raise InvalidArgument(f"--idle-s {args.idle_s} and --count {args.count} must be finite and >= 0 (0 = never)")
    start: Any = int(args.start) if args.start.isdigit() else args.start
    seen = 0
    with Consumer(args.name, args.nats_url, start=start, fetch=False) as c:
        while not args.count or seen < args.count:
            msg = c.receive(args.idle_s or 1.0)
            if msg is None:
                if args.idle_s:
                    break
                continue
            body = _json_or_none(msg) if msg.is_json and msg.kind == "inline" else None
            print(json.dumps({"seq": msg.seq, "subject": msg.subject, "kind": msg.kind, "bytes": msg.size,
                              **({"data": body} if body is not None else {}),
                              **({"error": str(msg.error)} if msg.error is not None else {})}), flush=True)
            msg.ack()
            seen += 1
    return 0


def _json_or_none(msg: Any) -> Any:
    """A notification's JSON, or None if its body is not JSON (anyone may publish to a stream)."""
    try:
        return msg.json()
    except MalformedMessage:
        return None


def _payload(args: argparse.Namespace) -> Any:
    """What `pub` publishes: the file's bytes, or DATA (stdin's bytes if absent) as they are or as JSON."""
    try:
        if args.file:
            with open(args.file, "rb") as f:
                return f.read()
        data = os.fsencode(args.data) if args.data is not None else sys.stdin.buffer.read()
    except OSError as e:
        raise InvalidArgument(f"cannot read {args.file or 'stdin'}: {e.strerror or e}") from e
    try:
        return json.loads(data) if args.json else data
    except ValueError as e:  # not JSON, or JSON not in UTF-8
        raise InvalidArgument(f"--json: the data is not JSON: {e}") from e


def _pub(args: argparse.Namespace) -> int:
    from kvpool.core import PoolClient

    from .producer import INLINE_MAX, Producer, encode

    payload = _payload(args)
    by_reference = len(encode(payload)[0]) > INLINE_MAX
    pool = PoolClient(mode="cluster", nats_url=args.nats_url) if by_reference else None
    try:
        with Producer(args.name, args.nats_url, pool=pool) as p:
            print(p.publish(payload, topic=args.topic))
    finally:
        if pool is not None:
            pool.close()
    return 0
