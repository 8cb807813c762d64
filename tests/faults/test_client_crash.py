"""kill -9 a same-node client that holds leases and half-written allocations in the worker's arena:
the worker reclaims both, and nothing half-written ever becomes visible."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from kvpool.core.client import PoolClient

from faulthelp import block, poll

MiB = 1 << 20

# Leases "held", reserves two slots ("half" and a new version of "held") and fills half of each,
# then waits to be killed: the state a client is in when it dies between ALLOC and COMMIT.
CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from kvpool.core import protocol as P
    from kvpool.core.transport import ShmTransport
    t = ShmTransport(sys.argv[1])
    lease = t.batch_lease([b"held"])
    views = lease.__enter__()
    assert views[0] is not None
    sizes = np.array([1 << 20, 1 << 20], dtype="<i8")
    with t._session() as sock:
        reply = t._roundtrip(sock, P.Op.ALLOC, P.pack_batch([b"half", b"held"], sizes))
    for off in np.frombuffer(reply.meta, dtype="<i8").tolist():
        assert off >= 0
        t.writable_arena[off:off + (1 << 19)] = b"\\xee" * (1 << 19)
    print("ready", flush=True)
    time.sleep(120)
""")


def test_a_killed_client_gives_back_leases_and_half_written_slots(spawn):
    w = spawn()
    with PoolClient(mode="local", worker=w.unix_path, timeout_s=5) as c:
        used = lambda: c.stats().total.dram_bytes  # noqa: E731
        c.put("held", block("held", MiB))
        child = subprocess.Popen([sys.executable, "-c", CHILD, w.unix_path], stdout=subprocess.PIPE)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"ready"
            assert used() == 3 * MiB  # "held" plus two reserved slots
            c.put("held", block("held", MiB, version=1))  # the leased version stays while leased
            assert used() == 4 * MiB
            assert c.batch_exists(["half"]) == [False]
            child.send_signal(signal.SIGKILL)
            assert child.wait(10) == -signal.SIGKILL
        finally:
            child.kill()
            child.wait()
            child.stdout.close()  # type: ignore[union-attr]
        assert poll(lambda: used() == MiB, 5), f"{used()} bytes still held after the client died"
        assert c.batch_exists(["half", "held"]) == [False, True]
        assert c.get("held") == block("held", MiB, version=1)
        # the reclaimed slots are reused, and what lands in them is exactly what was put
        keys = [f"after{i}" for i in range(40)]
        c.batch_put(keys, [block(k, MiB) for k in keys])
        bufs = [bytearray(MiB) for _ in keys]
        sizes = c.batch_get_into(keys, bufs)
        assert all(n < 0 or bytes(b) == block(k, MiB) for k, n, b in zip(keys, sizes, bufs))
        assert sizes[-8:] == [MiB] * 8


# As CHILD, then forks a helper that outlives it (a data loader's worker, say): the helper must not hold
# what the killed client held at the worker; and the helper can use the client itself, on its own socket.
FORKING_CHILD = textwrap.dedent("""
    import os, sys, time
    from kvpool.core.client import PoolClient
    c = PoolClient(mode="local", worker=sys.argv[1], timeout_s=5)
    lease = c.batch_lease(["held"])
    assert lease.__enter__()[0] is not None
    if os.fork() == 0:
        time.sleep(1)  # the parent is killed meanwhile
        c.put("from-child", b"c" * 4096)  # its own connection: the parent's socket is not shared
        assert c.get("from-child") == b"c" * 4096 and c.get("held") is not None
        print("child ok", flush=True)
        time.sleep(120)
        os._exit(0)
    print("ready", flush=True)
    time.sleep(120)
""")


def test_a_forked_child_does_not_keep_a_killed_clients_leases_and_uses_a_socket_of_its_own(spawn):
    w = spawn()
    with PoolClient(mode="local", worker=w.unix_path, timeout_s=5) as c:
        c.put("held", block("held", MiB))
        child = subprocess.Popen([sys.executable, "-c", FORKING_CHILD, w.unix_path], stdout=subprocess.PIPE,
                                 start_new_session=True)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"ready"
            assert poll(lambda: c.stats().total.dram_leases == 1, 5)
            child.send_signal(signal.SIGKILL)  # the forked helper lives on
            assert child.wait(10) == -signal.SIGKILL
            assert poll(lambda: c.stats().total.dram_leases == 0, 5), "the forked helper still holds the lease"
            assert child.stdout.readline().strip() == b"child ok"
        finally:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            child.stdout.close()  # type: ignore[union-attr]
