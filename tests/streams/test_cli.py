"""`kvpool streams ...` subcommands, driven through their argparse parser against a real nats-server."""
from __future__ import annotations

import argparse
import json

import pytest

from kvpool.streams import StreamNotFound
from kvpool.streams.cli import add_parser


def _run(nats, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvpool")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["streams", "--nats-url", nats.url, *argv])
    return args.func(args)


def test_create_pub_tail_info_ls_rm(nats, capsys, tmp_path):
    assert _run(nats, "create", "jobs", "--max-msgs", "100", "--discard", "new") == 0
    assert json.loads(capsys.readouterr().out)["max_msgs"] == 100
    _run(nats, "pub", "jobs", '{"block": "k1"}', "--json")
    _run(nats, "pub", "jobs", "--json", '{"block": "k2"}')  # the flag between the name and the data
    _run(nats, "pub", "jobs", "hello", "--topic", "note")
    assert capsys.readouterr().out.split() == ["1", "2", "3"]
    assert _run(nats, "tail", "jobs", "--start", "all", "--count", "3") == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines == [
        {"seq": 1, "subject": "kvpool.stream.jobs.msg", "kind": "inline", "bytes": 15, "data": {"block": "k1"}},
        {"seq": 2, "subject": "kvpool.stream.jobs.msg", "kind": "inline", "bytes": 15, "data": {"block": "k2"}},
        {"seq": 3, "subject": "kvpool.stream.jobs.note", "kind": "inline", "bytes": 5}]
    _run(nats, "info", "jobs")
    assert json.loads(capsys.readouterr().out)["messages"] == 3
    _run(nats, "ls")
    assert "jobs" in capsys.readouterr().out
    _run(nats, "rm", "jobs")
    _run(nats, "ls", "--json")
    assert json.loads(capsys.readouterr().out) == []
    with pytest.raises(StreamNotFound):
        _run(nats, "info", "jobs")


def test_tail_stops_when_idle_and_shows_reference_sizes_without_fetching(nats, capsys, tmp_path):
    from kvpool.core.client import PoolClient
    from kvpool.streams import Producer

    _run(nats, "create", "big")
    with PoolClient(dram_bytes="64MiB") as pool, Producer("big", nats.url, pool=pool, inline_max=10) as p:
        p.publish(b"x" * 5000)
    capsys.readouterr()
    assert _run(nats, "tail", "big", "--start", "1", "--idle-s", "0.3") == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line) == {"seq": 1, "subject": "kvpool.stream.big.msg", "kind": "ref", "bytes": 5000}


def test_pub_of_a_large_json_document_goes_by_reference(nats, spawn, capsys):
    spawn(nats_url=nats.url)
    _run(nats, "create", "docs")
    doc = {"blob": "x" * (300 << 10)}  # over the inline limit once encoded
    assert _run(nats, "pub", "docs", json.dumps(doc), "--json") == 0
    capsys.readouterr()
    assert _run(nats, "tail", "docs", "--start", "1", "--idle-s", "0.3") == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["kind"] == "ref"

