"""kvpool's own files are private whatever the umask, and it trusts no folder or file another user made
or can swap: a stranger who controls the state folder would otherwise plant NATS credentials (becoming
the server's admin) or links that make a root worker write where they point."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvpool.core.auth import private_dir, write_private
from kvpool.core.errors import ConfigError
from kvpool.core.nats_creds import creds_path, ensure_creds

NOBODY = 65534


def test_missing_folders_are_made_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        deep = private_dir(tmp_path / "a" / "b" / "state", tighten=True)
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", deep):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_a_folder_another_user_made_or_a_link_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)  # (the tests run as root, as the machine's CI does)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        private_dir(theirs, tighten=True)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        ensure_creds(theirs)  # kvpool up's NATS users: never read from a folder a stranger fills
    (tmp_path / "elsewhere").mkdir()
    mine = tmp_path / "mine"
    mine.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert private_dir(mine, tighten=True) == mine  # a link of our own (a data folder on another disk)
    planted = tmp_path / "planted"
    planted.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    os.lchown(planted, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="a link of uid 65534"):
        private_dir(planted, tighten=True)


def test_planted_credentials_are_not_trusted(tmp_path: Path) -> None:
    folder = tmp_path / "creds"
    made = ensure_creds(folder)
    assert ensure_creds(folder)["admin"].public_key == made["admin"].public_key  # ours are kept
    admin = creds_path("admin", folder)
    admin.unlink()
    admin.symlink_to(tmp_path / "planted.json")
    (tmp_path / "planted.json").write_text('{"user": "kvpool-admin", "password": "known-to-them"}')
    with pytest.raises(ConfigError, match="not a 0600 file of this user's"):
        ensure_creds(folder)
    admin.unlink()
    admin.write_text('{"user": "kvpool-admin", "password": "known-to-them"}')
    os.chown(admin, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="not a 0600 file of this user's"):
        ensure_creds(folder)


def test_a_private_write_goes_through_no_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "worker.alive"
    (tmp_path / f"worker.alive.tmp{os.getpid()}").symlink_to(victim)  # where the temporary file goes
    write_private(target, "123\n")
    assert victim.read_text() == "precious"
    assert target.read_text() == "123\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
