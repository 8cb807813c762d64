"""The PD handoff example (examples/streams/pd_handoff.py): a decode process waiting, a prefill process
placing locally, every byte checked; the decode side on the prefill's node, and on another node."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "streams" / "pd_handoff.py"


@pytest.mark.parametrize("decode_node, came", [(None, "in_place"), ("another-node", "from_pool")])
def test_the_decode_side_gets_every_layer_of_the_prefill(nats, worker, make_stream, decode_node, came) -> None:
    s = make_stream()
    args = ["--nats-url", nats.url, "--stream", s, "--request", "r1", "--timeout", "20"]
    env = {**os.environ, **({"KVPOOL_NODE_ID": decode_node} if decode_node else {})}
    decode = subprocess.Popen([sys.executable, str(EXAMPLE), "decode", *args], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        done = subprocess.run([sys.executable, str(EXAMPLE), "prefill", *args], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"request": "r1", "layers": 8}
        out, _ = decode.communicate(timeout=60)
    finally:
        decode.kill()
    assert decode.returncode == 0
    got = json.loads(out)
    assert (got["layers"], got["exact"], got[came]) == (list(range(8)), True, 8)
