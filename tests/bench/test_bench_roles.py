"""A writer process and a reader process that share only the cluster: the reader finds the writer's
keys through the window it publishes, sees hits, and checks their bytes without asking the writer."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from kvpool.core import PoolClient

from benchhelp import SMALL, Ran


def _bench(*argv: str) -> Ran:
    """`kvpool bench cache --json ...` in its own process: it shares nothing with the others but the cluster."""
    done = subprocess.run([sys.executable, "-m", "kvpool.core.cli", "bench", "cache", "--json", *argv],
                          capture_output=True, text=True, timeout=60, check=False)
    return Ran(done.returncode, done.stdout, done.stderr)


def test_reader_verifies_the_writers_blocks(nats, spawn) -> None:
    spawn(nats_url=nats.url)
    common = ["--cluster", nats.url, "--namespace", "t1", *SMALL]
    writer = _bench("--role", "writer", "--ops", "300", "--hit-rate", "0.5", *common)
    assert writer.rc == 0, writer.err
    reader = _bench("--role", "reader", "--ops", "100", *common)
    assert reader.rc == 0, reader.err
    m = reader.json["metrics"]
    assert m["role"] == "reader" and m["gets"] == 100
    assert m["hits"] == 100 and m["wrong_blocks"] == 0  # the pool holds the writer's whole window

    # the reader really checks bytes: corrupt every block of the window and read again
    with PoolClient(mode="cluster", nats_url=nats.url) as pool:
        window = json.loads(pool.get("t1/window"))
        for n in range(window["lo"], window["hi"]):
            pool.put(f"t1/{window['run']}/{n}", np.zeros(window["block_size"], dtype=np.uint8))
    reader = _bench("--role", "reader", "--ops", "20", *common)
    assert reader.rc == 1 and reader.json["metrics"]["wrong_blocks"] == 20
