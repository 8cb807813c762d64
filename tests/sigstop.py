"""SIGSTOP that waits for the stop: `os.kill` returns before a thread running on another core has taken
the signal, and a worker thread busy-polling its socket can still answer a request sent just after it
(a "paused" owner that served the read meant to time out on it, then applied a remove queued behind)."""
from __future__ import annotations

import os
import signal
import time


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP process `pid`; return once every one of its threads has stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} was sent SIGSTOP and did not stop within {timeout_s} s")
        time.sleep(0.001)


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (state T in /proc)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in ("T", "t") for s in states)
