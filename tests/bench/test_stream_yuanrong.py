"""`kvpool bench streams --peer yuanrong`: the layers handed off through openYuanrong's stream API
(a producer process, this process receiving, copying and acking), bytes checked, and its ratio."""
from __future__ import annotations

import argparse
import contextlib

import numpy as np
import pytest

from kvpool.core.bench import yuanrong_peer
from kvpool.streams import bench_yuanrong


def test_ratio_only_when_the_peer_ran() -> None:
    assert bench_yuanrong.ratios({"handoff": 1.0, "raw_socket": 2.0}) == {}
    assert bench_yuanrong.ratios({"handoff": 1.0, "yuanrong_stream": 4.0}) == {"handoff_vs_yuanrong_stream": 0.25}


def test_no_runs_without_the_peer() -> None:
    with contextlib.ExitStack() as stack:
        assert bench_yuanrong.runs(argparse.Namespace(peer=None), stack, np.zeros((2, 8), np.uint8)) == {}


@pytest.mark.peers
@pytest.mark.skipif(not yuanrong_peer.available(),
                    reason=f"openYuanrong datasystem is not installed: {yuanrong_peer.INSTALL}")
def test_stream_runs_receive_every_layer() -> None:
    layers = np.zeros((4, 64 << 10), np.uint8)  # the shape; the bytes are the producer's (checked per run)
    with contextlib.ExitStack() as stack:
        runs = bench_yuanrong.runs(argparse.Namespace(peer="yuanrong"), stack, layers)
        assert list(runs) == ["yuanrong_stream"]
        gen = runs["yuanrong_stream"]
        stack.callback(gen.close)  # as the suite does
        assert [next(gen) > 0 for _ in range(3)] == [True] * 3
