"""Workers cut from NATS only (they still serve their TCP clients) past their member TTL, then back.
Found by an adversarial check: a worker back from such a lapse said it had been a member since it
noticed the lapse, long before clients heard of it again, so a put did not tell a newcomer below it that
had taken its keys meanwhile (200 of 200 keys served old once the old owners left); and clients dropped
a worker after their own 10 s TTL where the worker's was longer, writing its keys elsewhere while it
never fenced itself (200 of 200 served old once it was back), and so did a client that started while
the worker had aged out of a member bucket a client had made with its own TTL. Real nats-server and
`kvpool worker`s."""
from __future__ import annotations

import time

from kvpool.core import PoolClient
from kvpool.core.cluster import Membership, rank

from faulthelp import block, is_block_of
from tcpproxy import TcpProxy

SIZE = 4096
FAST = {"KVPOOL_HEARTBEAT_S": "0.5", "KVPOOL_MEMBER_TTL_S": "3"}


def _members(pool: PoolClient, ids: set[str], timeout_s: float = 20) -> None:
    assert pool.wait_for_members(lambda m: set(m) == ids, timeout_s), f"members {sorted(pool.members())}"


def _none_older(keys: list[str], got: list[bytes | None], version: int) -> None:
    """Each key read is a miss or its block number `version` (the last put)."""
    stale = [k for k, g in zip(keys, got) if g is not None and not is_block_of(k, g, version)]
    assert stale == [], f"{len(stale)} of {len(keys)} keys served older than the last put"


def test_a_worker_back_from_a_lapse_is_a_member_again_from_its_return(nats, spawn) -> None:
    """A and B lapse; newcomer W, ranked below both, takes their keys; once A and B are back and own
    them again, a put tells W too (A and B have been members only since their return), so with A and
    B gone W serves nothing older."""
    cut = TcpProxy((nats.host, nats.port))
    old = [spawn(nats_url=f"nats://{cut.address}", env=FAST, extra=["--worker-id", w]) for w in ("A", "B")]
    try:
        with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=3, node_id="client") as pool:
            pool.backend.membership.ttl_s = 3.0  # (as the workers': it drops them soon after they lapse)
            _members(pool, {"A", "B"})
            keys = [k for k in (f"lapse/{i}" for i in range(1000))
                    if rank(k.encode(), ["A", "B", "W"])[2] == "W"][:100]
            pool.batch_put(keys, [block(k, SIZE, 1) for k in keys])
            cut.cut()
            _members(pool, set())
            started = time.monotonic()
            spawn(nats_url=nats.url, env=FAST, extra=["--worker-id", "W"])
            _members(pool, {"W"})
            time.sleep(4.0)  # W holds its blocks from well before A and B are back (past the margin)
            pool.batch_put(keys, [block(k, SIZE, 2) for k in keys])
            time.sleep(max(0.0, 8.0 - (time.monotonic() - started)))
            cut.restore()
            _members(pool, {"A", "B", "W"})
            time.sleep(3.0)  # A and B catch up from W
            pool.batch_put(keys, [block(k, SIZE, 3) for k in keys])  # to A, first again
            pool.backend.supersedes.wait()
            for w in old:
                w.stop(timeout=10)
            _members(pool, {"W"})
            got = [pool.get(k) for k in keys]
    finally:
        cut.close()
    _none_older(keys, got, 3)


def test_clients_keep_a_worker_as_long_as_its_own_member_ttl(nats, spawn) -> None:
    """A worker with a member TTL longer than a client's is kept by the client that long: its keys are
    not written elsewhere while it has not fenced itself, and it serves the newest version when back."""
    cut = TcpProxy((nats.host, nats.port))
    slow = {"KVPOOL_HEARTBEAT_S": "0.5", "KVPOOL_MEMBER_TTL_S": "8"}
    spawn(nats_url=f"nats://{cut.address}", env=slow, extra=["--worker-id", "A"])
    spawn(nats_url=nats.url, env=slow, extra=["--worker-id", "B"])
    try:
        with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=3, node_id="client") as pool:
            pool.backend.membership.ttl_s = 3.0  # the client's own TTL, shorter than the workers'
            _members(pool, {"A", "B"})
            keys = [k for k in (f"ttl/{i}" for i in range(400)) if rank(k.encode(), ["A", "B"])[0] == "A"][:100]
            pool.batch_put(keys, [block(k, SIZE, 1) for k in keys])
            cut.cut()
            time.sleep(4.5)  # past the client's TTL, within A's
            assert set(pool.members()) == {"A", "B"}
            pool.batch_put(keys, [block(k, SIZE, 2) for k in keys])  # to A still (it serves TCP)
            cut.restore()
            time.sleep(2.0)
            _members(pool, {"A", "B"})
            got = [pool.get(k) for k in keys]
    finally:
        cut.close()
    _none_older(keys, got, 2)


def test_a_bucket_a_client_made_keeps_entries_as_long_as_the_workers_ttl(nats, spawn) -> None:
    """A client that makes the member bucket first gives it its own TTL; the workers raise it to theirs.
    Otherwise a worker cut from NATS would age out of the bucket before it fences itself, and a client
    that starts meanwhile would write its keys elsewhere (an adversarial check: 200 of 200 served old)."""
    first = Membership(nats.url, ttl_s=3.0)  # a client's: it makes the bucket, entries kept 3 s
    try:
        cut = TcpProxy((nats.host, nats.port))
        slow = {"KVPOOL_HEARTBEAT_S": "0.5", "KVPOOL_MEMBER_TTL_S": "8"}
        spawn(nats_url=f"nats://{cut.address}", env=slow, extra=["--worker-id", "A"])
        spawn(nats_url=nats.url, env=slow, extra=["--worker-id", "B"])
        try:
            cut.cut()
            time.sleep(5.0)  # past the bucket's first TTL, within A's
            with PoolClient(mode="cluster", nats_url=nats.url, timeout_s=3, node_id="late") as late:
                assert late.wait_for_members(lambda m: {"A", "B"} <= set(m), 5), sorted(late.members())
        finally:
            cut.close()
    finally:
        first.close()
