"""kill -9 a same-node client that holds leases and half-written allocations in the worker's arena:
the worker reclaims both, and nothing half-written ever becomes visible."""
from __future__ import annotations

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
    with t._session():
        reply = t._roundtrip(P.Op.ALLOC, P.pack_batch([b"half", b"held"], sizes))
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
