"""A worker's start sweeps the per-port files dead workers left in the state dir, never a live one's
(`kvpool.core.state_files`). A worker restarting on the port of one killed there (its socket file left
behind) replaces that file with its own live socket; a sweep by another worker starting at the same
moment must not remove the new one. The interleaving is made exact here: the sweep's last look at the
listening ports is taken just before the restarting worker listens on its port and binds its socket
(under `binding`, as `Worker` does), which could otherwise come before the sweep's unlink."""
from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from kvpool.core import state_files
from kvpool.core.nats_server import free_port


def test_a_sweep_never_removes_the_socket_of_a_worker_restarting_on_a_dead_ones_port(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    path = tmp_path / f"worker-{port}.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # a killed worker's socket: the file stays, nothing listens
    dead.close()
    real = state_files._listening_ports
    held: list[socket.socket] = []
    tried_to_bind, bound = threading.Event(), threading.Event()

    def restart() -> None:  # as `Worker.__init__` does: TCP first, then its Unix socket in place of the dead one's
        held.append(socket.create_server(("127.0.0.1", port)))
        tried_to_bind.set()
        with state_files.binding(tmp_path):
            if path.exists():
                os.unlink(path)
            live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            live.bind(str(path))
            live.listen(8)
            held.append(live)
        bound.set()

    starter = threading.Thread(target=restart)
    calls = [0]

    def listening_then_a_worker_starts() -> set[int] | None:
        seen = real()
        calls[0] += 1
        if calls[0] == 2:  # the sweep's second look ("it may be one a worker starts right now") ...
            starter.start()  # ... and right after it a worker starts on that port
            assert tried_to_bind.wait(5)
            bound.wait(0.5)  # it binds now, unless the sweep's lock holds it off until the sweep ends
        return seen

    monkeypatch.setattr(state_files, "_listening_ports", listening_then_a_worker_starts)
    try:
        assert state_files.sweep_dead_workers(tmp_path) == 1  # the dead one's file
        starter.join(10)
        assert calls[0] == 2, "the interleaving was not reached"
        assert path.exists(), "the sweep removed the socket of a worker that had just bound it"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with probe:
            probe.connect(str(path))  # the live one's
    finally:
        for s in held:
            s.close()


def test_a_lock_held_too_long_is_not_waited_for(tmp_path: Path) -> None:
    """A process stopped while it holds the lock delays a start by `wait_s`, never for ever."""
    with state_files.binding(tmp_path):
        entered = threading.Event()

        def other() -> None:
            with state_files.binding(tmp_path, wait_s=0.2):
                entered.set()
        t = threading.Thread(target=other)
        t.start()
        t.join(5)
        assert entered.is_set()
