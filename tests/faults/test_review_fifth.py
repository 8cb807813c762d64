"""Review of the fixes 2edbc5a, 0518bca, afdee06, dbfd238, 5eae4a3, c546466 and 951b306 (streams purges,
connection waits and interrupted fan-outs, vLLM saves after a failed load, tiered-cache races): what they
got wrong or left. Each test names the bug it shows."""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.core import TieredCache
from kvpool.core.client import PoolClient
from kvpool.core.errors import KVPoolError
from kvpool.core.nats_server import NatsServer
from kvpool.core.procs import WorkerProcess
from kvpool.core.tier_moves import TierMoves

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
from corehelp import SMALL, KiB, payload


def _in_thread(call: Callable[[], Any], name: str) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as e:  # reported by the test
            out.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, out


# Bug: a read racing close() still raises a raw TypeError ("a bytes-like object is required, not
# 'NoneType'") where the block's checksum is checked on that read (verify_dram_reads, or a block's first
# read after an unchecked commit): TierMoves.verified_many hashes
# stack.dram.arena.buf (None once closed) outside `_closing_met` (tier_moves.py verified_many / acquire_many,
# cache.py _readable and _get_into call `verified` outside it), not PoolClosed.
def test_a_read_checking_its_block_while_close_runs_raises_a_kvpool_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = TieredCache(**SMALL, verify_dram_reads=True)
    data = payload("k", 10 * KiB)
    cache.put("k", data)
    real = TierMoves.verified_many
    entered, go = threading.Event(), threading.Event()

    def verified_many(moves: TierMoves, blocks: Any) -> Any:
        if threading.current_thread().name == "reader" and not entered.is_set():
            entered.set()
            go.wait(10)  # the block is leased; close() runs now
        return real(moves, blocks)

    monkeypatch.setattr(TierMoves, "verified_many", verified_many)
    reader, got = _in_thread(lambda: cache.get("k"), "reader")
    assert entered.wait(10)
    cache.close()
    go.set()
    reader.join(10)
    assert got, "the read hung"
    assert got[0] in (None, data) or isinstance(got[0], KVPoolError), f"an untyped error: {got[0]!r}"


# Bug: a receiver reading a request id again gives up with HandoffTimeout after its own `timeout` when the
# earlier request's purge is still under way (2edbc5a, handoff.iter_layers) -- and that purge ALWAYS takes
# over _END_STORED_S (1 s) exactly when the id's next request was published right after the first: its
# end came live, the subject's last stored message is the next request's, so `_purge` polls stored_last
# for the whole second before it scans. With every layer of the second request stored and NATS healthy, a
# receiver with a per-layer timeout under 1 s fails every reuse of an id ("is NATS reachable?").
def test_reading_an_id_again_right_after_its_next_request_is_stored_does_not_time_out(nats: NatsServer,
                                                                                    spawn: Callable[..., WorkerProcess]
                                                                                    ) -> None:
    from kvpool.streams import HandoffReceiver, HandoffTimeout, Producer, StreamConfig, create_stream

    block = 64 << 10
    spawn(nats_url=nats.url)
    s = "rv5a"
    create_stream(nats.url, s, StreamConfig())
    with PoolClient(mode="cluster", nats_url=nats.url) as pool:
        assert pool.wait_for_members(lambda m: len(m) == 1, 15)
        old = [np.full(block, 1 + layer, dtype=np.uint8) for layer in range(2)]
        new = [np.full(block, 7 + layer, dtype=np.uint8) for layer in range(2)]

        def produce() -> None:
            time.sleep(1.0)  # the receiver is subscribed: the first request comes live
            with Producer(s, nats.url, pool=pool) as p:
                for layer in range(2):
                    p.publish_kv("rid", layer, [f"rid-old/L{layer}"], [old[layer]])
                p.end_request("rid", 2)
                for layer in range(2):  # the prefill side's next request of this id, right after
                    p.publish_kv("rid", layer, [f"rid-new/L{layer}"], [new[layer]])
                p.end_request("rid", 2)

        t = threading.Thread(target=produce)
        with HandoffReceiver(s, nats.url, pool) as rx:
            t.start()
            for layer, _, _ in rx.iter_layers("rid", timeout=10):
                if layer == 1:
                    t.join(20)  # the second request is stored before the first one's end is taken (live)
            try:
                got = [(layer, keys, [bytes(b) for b in bufs])
                       for layer, keys, bufs in rx.iter_layers("rid", timeout=0.8)]
            except HandoffTimeout as e:
                pytest.fail(f"every layer of the second request is stored, NATS is up: {e}")
    assert got == [(layer, [f"rid-new/L{layer}"], [new[layer].tobytes()]) for layer in range(2)]
