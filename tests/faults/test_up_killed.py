"""`kvpool up` killed with -9, with real processes: its nats-server goes with it, and the arena it leaves
(its worker runs in its own process) is swept by the next worker started on the node, while a live
worker's arena is never touched. (tests/core/test_dram.py checks the sweep in-process only.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prochelp import alive, children

from kvpool.core.nats_server import free_port
from kvpool.core.tiers.dram import arena_names


def _poll(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def test_a_killed_up_leaves_no_nats_server_and_its_arena_is_swept_by_the_next_worker(spawn, tmp_path: Path) -> None:
    live = spawn()  # a live worker on the node: its arena must survive every sweep
    live_arenas = arena_names(live.proc.pid)
    assert live_arenas
    env = {**os.environ, "KVPOOL_STATE_DIR": str(tmp_path / "up")}
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115
    up = subprocess.Popen([sys.executable, "-m", "kvpool.core.cli", "up", "--port", str(free_port()),
                           "--nats-port", str(free_port()), "--dram-bytes", "32MiB"],
                          env=env, stdout=log, stderr=subprocess.STDOUT)
    nats_pids: list[int] = []
    try:
        up_log = tmp_path / "up.log"
        assert _poll(lambda: "kvpool is up" in up_log.read_text(errors="replace") or up.poll() is not None, 60), \
            "kvpool up did not come up"
        assert up.poll() is None, (tmp_path / "up.log").read_text(errors="replace")[-2000:]
        nats_pids = [p for p, cmd in children(up.pid).items() if "nats-server" in cmd]
        assert nats_pids
        left = arena_names(up.pid)
        assert left
        up.send_signal(signal.SIGKILL)
        up.wait()
        assert _poll(lambda: not any(alive(p) for p in nats_pids), 10), "nats-server outlived kvpool up"
        assert arena_names(up.pid) == left  # nobody unlinked it yet: the next worker start must
        spawn()
        assert arena_names(up.pid) == set(), "a new worker did not sweep the killed kvpool up's arena"
        assert arena_names(live.proc.pid) == live_arenas, "a live worker's arena was swept"
        assert live.proc.poll() is None
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()
        for p in nats_pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        for name in arena_names(up.pid):
            os.unlink(f"/dev/shm/{name}")
