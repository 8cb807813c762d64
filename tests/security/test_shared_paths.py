"""Adversarial checks of paths kvpool writes where another Unix user (`nobody`) may have been first: the
nats-server folder kvpool writes its config and log into, and the kvtest NATS start lock in the shared
temp folder. README: "kvpool's files and folders are made private whatever the umask, and a state
folder (or NATS credentials file) that is another user's, or a link, is refused"; and bad input (here,
a stranger's file) gets a clear error, never a hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from workerhelp import NOBODY, need_root, open_folder

from kvpool.core.errors import ConfigError, KVPoolError
from kvpool.core.nats_creds import authorization, ensure_creds
from kvpool.core.nats_server import NatsServer, free_port


def test_nats_server_refuses_a_folder_another_user_controls(tmp_path: Path) -> None:
    """`NatsServer.start` makes its folder with `private_dir(store_dir)` without `tighten`, and opens
    `nats-server.conf` with O_CREAT|O_TRUNC but no O_NOFOLLOW: in a folder a stranger owns (or can write),
    a planted `nats-server.conf` link makes kvpool truncate and overwrite whatever file it names with the
    server's config (and a planted `nats-server.log` link has the server append its log there)."""
    need_root()
    creds = ensure_creds(tmp_path / "creds")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    with open_folder() as shared:
        store = shared / "nats"
        store.mkdir()
        os.chown(store, NOBODY, NOBODY)
        store.chmod(0o777)
        (store / "nats-server.conf").symlink_to(victim)  # planted by the stranger
        os.lchown(store / "nats-server.conf", NOBODY, NOBODY)
        server = NatsServer(store, port=0, authorization=authorization(creds))
        try:
            with pytest.raises((ConfigError, OSError)):
                server.start()
        finally:
            server.stop()
    assert victim.read_text() == "precious\n", "kvpool wrote the nats-server config through a planted link"


def test_a_strangers_kvtest_lock_file_does_not_hang_the_start() -> None:
    """kvtest's NATS start lock was `<tmp>/kvpool-kvtest-nats-<port>.lock`, opened O_CREAT (so a file a
    stranger made first was opened, if its mode let us) and locked with a blocking flock: a stranger
    who made that file readable and held a lock on it stopped every kvtest instance of that port from
    starting, for ever. It is now in this user's private state folder: the stranger's file is no lock."""
    need_root()
    from kvpool.core.bench import kvtest_instance

    port = free_port()
    path = Path(tempfile.gettempdir()) / kvtest_instance._LOCK_NAME.format(port=port)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
        fd = os.open({str(path)!r}, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        outcome: list[object] = []

        def start() -> None:
            try:
                with kvtest_instance._port_lock(port):
                    outcome.append("entered")
            except (KVPoolError, OSError) as e:
                outcome.append(e)

        t = threading.Thread(target=start, daemon=True)
        t.start()
        t.join(10)
        assert outcome == ["entered"], "kvtest's NATS start waits on a lock file another user holds"
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def test_a_client_does_not_use_nats_credentials_another_user_planted(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`find_creds` (every NATS connection: cluster clients, workers, streams, status) reads
    `<state dir>/nats/<role>.json` with no check of its owner, mode or a link, unlike `ensure_creds`
    and the token file (`auth._read_token`): a stranger who owns the state folder (a shared
    KVPOOL_STATE_DIR) picks the NATS identity this user's processes log in as."""
    need_root()
    from kvpool.core.nats_creds import find_creds, new_user_seed

    state = tmp_path / "state"
    (state / "nats").mkdir(parents=True)
    planted = state / "nats" / "client.json"
    planted.write_text(json.dumps({"user": "theirs", "nkey_seed": new_user_seed()}))
    planted.chmod(0o644)
    for p in (state, state / "nats", planted):
        os.chown(p, NOBODY, NOBODY)
    monkeypatch.setenv("KVPOOL_STATE_DIR", str(state))
    with pytest.raises(ConfigError):
        find_creds("client")
