"""The processes of a peer system that a bench starts: each in its own process group, dying with the
bench (PR_SET_PDEATHSIG), stopped group-wide, its log's tail quoted in errors."""
from __future__ import annotations

import os
import signal
import subprocess
from typing import IO, Any

from ..nats_server import die_with_parent

__all__ = ["spawn", "stop", "tail"]


def spawn(args: list[str], log: IO[bytes], **kw: Any) -> subprocess.Popen[Any]:
    # Its own process group, so cleanup reaches everything it starts; and it dies with us.
    return subprocess.Popen(args, stderr=log, start_new_session=True, preexec_fn=die_with_parent(), **kw)


def stop(proc: subprocess.Popen[Any]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the group id is the child's pid
            proc.wait(5)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read()[-2000:].decode(errors="replace")
