"""Workers, NATS nodes and clients on different hosts (network namespaces): bytes, staleness and call
deadlines across hosts, through the loss of a NATS node, a cut cable and an asymmetric partition."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mhcluster import CALL_TIMEOUT_S, MEMBER_TTL_S, TOKEN, WORKER_HOSTS, Agent, Cluster

SIZE = 64 << 10
SLACK = 1.2  # a call may overrun its deadline by at most 20%


def keys_of(tag: str, n: int = 48) -> list[str]:
    return [f"{tag}/{i}" for i in range(n)]


def check_call(reply: dict[str, object]) -> None:
    assert float(reply["s"]) <= CALL_TIMEOUT_S * SLACK, f"call took {reply['s']:.2f} s (timeout {CALL_TIMEOUT_S} s)"


def put(agent: Agent, keys: list[str], version: int) -> None:
    reply = agent("put", keys=keys, version=version, size=SIZE)
    check_call(reply)
    assert reply.get("ok"), reply


def read(agent: Agent, keys: list[str]) -> list[object]:
    reply = agent("get", keys=keys, size=SIZE)
    check_call(reply)
    assert "error" not in reply, reply
    versions = list(reply["versions"])
    assert "wrong" not in versions, f"wrong bytes served: {versions}"
    return versions


def read_until_whole(agent: Agent, keys: list[str], judge: Callable[[list[object]], None],
                     timeout: float = 3 * MEMBER_TTL_S) -> list[object]:
    """Read until no key misses, judging every read. After a NATS node leaves or comes back, JetStream may
    re-elect the members stream's leader for longer than a worker's heartbeats may lapse: the workers
    fence themselves (reads are misses, never older bytes) until they have caught up from their peers."""
    deadline = time.monotonic() + timeout
    while True:
        versions = read(agent, keys)
        judge(versions)
        if -1 not in versions or time.monotonic() > deadline:
            return versions
        time.sleep(0.5)


ALL = sorted(f"w-{h}" for h in WORKER_HOSTS)


def wait_members(agent: Agent, ids: list[str], timeout: float) -> dict[str, str]:
    """The members `agent` sees once they are `ids` (or the last seen, after `timeout` seconds). Not as
    soon as their number is right: a worker dropped for a moment while another is still listed counts
    the same."""
    deadline = time.monotonic() + timeout
    while True:
        members = dict(agent("members")["members"])
        if sorted(members) == sorted(ids) or time.monotonic() > deadline:
            return members
        time.sleep(0.5)


def test_members_advertise_addresses_other_hosts_reach(cluster: Cluster) -> None:
    members = wait_members(cluster.agent("h4"), ALL, 15)
    assert sorted(members.values()) == sorted(f"{cluster.lab.addr(h)}:7461" for h in WORKER_HOSTS)


def test_puts_and_gets_across_hosts(cluster: Cluster) -> None:
    for r in (1, 2):
        remote, local = cluster.agent("h4", replication=r), cluster.agent("h1", replication=r)
        keys = keys_of(f"across-r{r}")
        put(remote, keys, 1)
        assert read(local, keys) == [1] * len(keys)  # h1 reads its own worker's share through shared memory
        assert read(remote, keys) == [1] * len(keys)


def test_status_from_any_host(cluster: Cluster) -> None:
    for host in ("h4", "h2"):
        out = subprocess.run(["ip", "netns", "exec", cluster.lab.ns(host), sys.executable, "-m", "kvpool.core.cli",
                              "status", "--nats-url", cluster.nats_url, "--token", TOKEN, "--json"],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, **cluster.creds_env("client")})
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout.strip().splitlines()[-1])
        assert sorted(stats) == sorted(f"w-{h}" for h in WORKER_HOSTS), stats


def test_losing_one_nats_node_keeps_membership_and_data(cluster: Cluster) -> None:
    agent = cluster.agent("h4", replication=2)
    keys = keys_of("nats-loss")
    cluster.lab.stop(cluster.nats["h3"])
    try:
        time.sleep(MEMBER_TTL_S + 2)  # heartbeats must have gone through the other two nodes meanwhile
        # every worker heartbeats through the two nodes left (a client that was on the lost node re-watches)
        assert sorted(wait_members(agent, ALL, 10)) == ALL
        put(agent, keys, 1)
        assert read(agent, keys) == [1] * len(keys)
    finally:
        cluster.start_nats("h3")


def test_cut_worker_is_dropped_and_serves_nothing_stale_when_back(cluster: Cluster) -> None:
    agent = cluster.agent("h4", replication=1)
    keys = keys_of("cut")
    overwritten, removed = keys[: len(keys) // 2], keys[len(keys) // 2:]
    put(agent, keys, 1)
    cluster.lab.cut("h2")
    try:
        assert set(read(agent, keys)) <= {1, -1}  # before the member TTL: misses where h2 owned the key
        members = wait_members(agent, ["w-h1", "w-h3"], MEMBER_TTL_S + 10)
        assert sorted(members) == ["w-h1", "w-h3"], members
        put(agent, overwritten, 2)
        reply = agent("remove", keys=removed)
        check_call(reply)
        assert "error" not in reply, reply
    finally:
        cluster.lab.restore("h2")
    assert sorted(wait_members(agent, ALL, MEMBER_TTL_S + 10)) == ALL
    versions = read(agent, keys)
    assert set(versions[: len(overwritten)]) <= {2, -1}, f"stale versions after h2 came back: {versions}"
    assert set(versions[len(overwritten):]) == {-1}, f"removed keys came back: {versions}"


def test_client_cut_from_one_worker_reads_nothing_stale(cluster: Cluster) -> None:
    """R=1 (R=2 replicas carry no versions yet: a replica that missed a put may serve the one before)."""
    cut_off, whole = cluster.agent("h4"), cluster.agent("h1")
    keys = keys_of("asym")
    put(cut_off, keys, 1)
    cluster.lab.blackhole("h4", "h2")
    try:
        reply = cut_off("put_each", keys=keys, version=2, size=SIZE)
        acked = reply["acked"]
        assert 0 < sum(acked) < len(keys), "some keys live on h2, some elsewhere"
        assert set(read(cut_off, keys)) <= {2, -1}
    finally:
        cluster.lab.heal("h4", "h2")
    # (NATS re-elects across the healed link: a view without h2 for a while would read its keys as misses)
    assert sorted(wait_members(whole, ALL, MEMBER_TTL_S + 10)) == ALL

    def judge(versions: list[object]) -> None:
        stale = [(k, v) for k, v, a in zip(keys, versions, acked) if a and v not in (2, -1)]
        assert not stale, f"acknowledged puts read back older: {stale}"

    versions = read_until_whole(whole, keys, judge)
    assert all(v == 2 for v, a in zip(versions, acked) if a), versions  # nothing acknowledged was lost
    # A key whose put raised reads version 1 (h2 kept it), a miss (h2 dropped it as it caught up after the
    # re-election: the worker below was told of the failed put and logged it, `ReplicaState.supersede`),
    # or version 2: a put that raised may still have been stored (README; e.g. its owner's answer came
    # past the call's deadline: CI at de0f3a8, a loaded machine, read 2 for some). Never wrong bytes.
    assert {v for v, a in zip(versions, acked) if not a} <= {1, 2, -1}, versions


def _hand_off(cluster: Cluster, request: str, placement: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A prefill on h1 (beside a worker) and a decode instance on h4 (remote to every worker) hand one
    request off through a stream of their own; what each printed."""
    lab, script = cluster.lab, str(Path(__file__).with_name("handoff.py"))
    # the cluster has settled from the tests before (a partition healed, a NATS node restarted)
    assert sorted(wait_members(cluster.agent("h4"), ALL, MEMBER_TTL_S + 10)) == ALL

    def on(host: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", lab.ns(host), sys.executable, *argv]

    made = subprocess.run(on("h4", "-m", "kvpool.core.cli", "streams", "--nats-url", cluster.nats_url, "create",
                             f"handoff-{placement}", "--replicas", "3"), capture_output=True, text=True, timeout=60,
                          env={**os.environ, **cluster.creds_env("admin")})
    assert made.returncode == 0, made.stderr
    opts = json.dumps({"nats_url": cluster.nats_url, "token": TOKEN, "stream": f"handoff-{placement}",
                       "request": request, "placement": placement})
    client = {**os.environ, **cluster.creds_env("client")}
    decode = subprocess.Popen(on("h4", script, "decode", opts), stdout=subprocess.PIPE, text=True, env=client)
    prefill = subprocess.run(on("h1", script, "prefill", opts), capture_output=True, text=True, timeout=90,
                             env=client)
    assert prefill.returncode == 0, prefill.stderr
    out, _ = decode.communicate(timeout=90)
    return json.loads(prefill.stdout.strip().splitlines()[-1]), json.loads(out.strip().splitlines()[-1])


def test_prefill_to_decode_handoff_across_hosts(cluster: Cluster) -> None:
    _, got = _hand_off(cluster, "req-x", "hash")
    assert (got["layers"], got["exact"]) == (list(range(6)), True)
    assert sum(got["holders"].values()) == 12


def test_a_locally_placing_prefill_keeps_its_layers_on_its_host(cluster: Cluster) -> None:
    prefill, got = _hand_off(cluster, "req-local", "local")
    assert (got["layers"], got["exact"]) == (list(range(6)), True)  # read from h1's worker by their places
    assert got["holders"] == {node: 12 if node == prefill["node"] else 0 for node in got["holders"]}
    assert len(got["holders"]) == 3
