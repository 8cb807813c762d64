"""A bench's child processes end with the bench however it ends: a SIGTERM (what `timeout` sends) or a
kill -9 of `kvpool bench transport` must not leave its raw-socket baseline server (1 GiB touched)
listening for ever, as its workers (KVPOOL_PARENT_PID) and nats-servers (PDEATHSIG) already do not; and a
SIGTERM leaves no temporary state folder, as Ctrl-C does not."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prochelp import alive, children


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_a_killed_transport_bench_leaves_no_raw_socket_server(tmp_path: Path, sig: int) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "bench", "transport", "--quick"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    raw: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not raw and time.monotonic() < deadline and bench.poll() is None:
            raw = [p for p, cmd in children(bench.pid).items() if "raw_socket" in cmd]
            time.sleep(0.05)
        assert raw, "the bench never started its raw-socket server"
        time.sleep(0.3)  # it listens; the bench is starting its worker
        bench.send_signal(sig)
        bench.wait(30)
        deadline = time.monotonic() + 5
        while alive(raw[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(raw[0]), \
            f"the raw-socket server (pid {raw[0]}) outlived its bench ({signal.Signals(sig).name})"
        if sig == signal.SIGTERM:  # a SIGTERM (`timeout`) cleans up as Ctrl-C does: no state folder left
            left = sorted(p.name for p in tmp_path.glob("kvpool-bench-*"))
            assert not left, f"temporary folders left by a SIGTERM'd bench: {left}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in raw:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
