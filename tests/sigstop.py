"""SIGSTOP that waits for the stop: `os.kill` returns before every thread of the process has taken the
signal (one running on another core takes it later), and a worker could still answer a request sent
just after it (seen: a "paused" owner served the read meant to time out on it, so the client did not
skip it, and applied on SIGCONT the remove the test expected never to reach it)."""
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
