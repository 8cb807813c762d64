"""NATS users per role, and where processes find theirs: what `kvpool up` secures its nats-server with.

Roles: `worker` writes membership and block events; `client` reads membership and events and uses
existing streams; `admin` may do anything (create and delete streams). Each role's user and password
are a JSON file `{"user": ..., "password": ...}`, 0600, in `<state dir>/nats/` (0700); a process finds
its role's file there, or uses the one file named by `KVPOOL_NATS_CREDS` (hand a machine only the
role it needs). A URL with credentials in it (`nats://user:pass@host`) is used as it is.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
from pathlib import Path
from typing import Any, Literal

from .config import default_state_dir
from .errors import ConfigError

__all__ = ["Role", "ROLES", "MEMBERS_BUCKET", "EVENTS_SUBJECTS", "STREAM_SUBJECTS", "DEAD_LETTER_SUBJECTS",
    "PERMISSIONS", "NatsCreds", "creds_dir", "creds_path", "load_creds", "find_creds", "ensure_creds", "authorization"]

Role = Literal["worker", "client", "admin"]
ROLES: tuple[Role, ...] = ("worker", "client", "admin")

MEMBERS_BUCKET = "kvpool_members"
EVENTS_SUBJECTS = "kvpool.events.>"
STREAM_SUBJECTS = "kvpool.stream.>"
DEAD_LETTER_SUBJECTS = "kvpool.dead.>"

_USE_JS = ["$JS.API.INFO", "$JS.API.STREAM.INFO.>", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
           "$JS.API.STREAM.MSG.GET.>", "$JS.API.DIRECT.GET.>", "$JS.API.CONSUMER.>", "$JS.ACK.>", "$JS.FC.>",
           "$JS.API.STREAM.PURGE.>"]
"""JetStream API calls that read streams, use consumers, or purge (a finished handoff purges its
request). No stream create/update: a stream's config can republish its messages onto any subject as
the server (past the user's publish permissions), so who may configure streams may write the member
bucket (tests/security/test_nats_auth.py shows it)."""
_KEEP_OFF = [f"$JS.API.STREAM.PURGE.KV_{MEMBERS_BUCKET}", "$JS.API.STREAM.PURGE.KVPOOL_EVENTS"]

PERMISSIONS: dict[Role, dict[str, dict[str, list[str]]]] = {
    "worker": {"publish": {"allow": ["$JS.API.>", f"$KV.{MEMBERS_BUCKET}.>", EVENTS_SUBJECTS, "$JS.ACK.>",
                                     "$JS.FC.>", "_INBOX.>"]},
               "subscribe": {"allow": ["_INBOX.>", f"$KV.{MEMBERS_BUCKET}.>", "kvpool.>"]}},
    "client": {"publish": {"allow": [*_USE_JS, STREAM_SUBJECTS, DEAD_LETTER_SUBJECTS, "_INBOX.>"],
                           "deny": _KEEP_OFF},
               "subscribe": {"allow": ["_INBOX.>", f"$KV.{MEMBERS_BUCKET}.>", "kvpool.>"]}},
    "admin": {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}},
}
"""What each role's NATS user may publish and subscribe to (nats-server `permissions`)."""


@dataclasses.dataclass(frozen=True)
class NatsCreds:
    """A NATS user and password; `path` is the file they came from (for messages), if any."""

    user: str
    password: str = dataclasses.field(repr=False)
    path: str | None = None


def creds_dir(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where `kvpool up` keeps the NATS credentials: `<state dir>/nats`."""
    return Path(state_dir) if state_dir is not None else default_state_dir() / "nats"


def creds_path(role: Role, folder: str | os.PathLike[str] | None = None) -> Path:
    """The credentials file of `role` in `folder` (default `creds_dir()`)."""
    return creds_dir(folder) / f"{role}.json"


def load_creds(path: str | os.PathLike[str]) -> NatsCreds:
    """The user and password in a credentials file; ConfigError naming the file if it is not one."""
    try:
        data: Any = json.loads(Path(path).read_text())
        return NatsCreds(str(data["user"]), str(data["password"]), str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"NATS credentials file {path}: {type(e).__name__}: {e} "
                          '(expected JSON {"user": ..., "password": ...})') from e


def find_creds(role: Role, path: str | os.PathLike[str] | None = None) -> NatsCreds | None:
    """The credentials to connect as `role`: the file `path` if given, else the one named by
    `KVPOOL_NATS_CREDS`, else `<state dir>/nats/<role>.json` if it exists; None when there are none
    (an unsecured server, or one that will refuse us: see `nats_connect`)."""
    explicit = path or os.environ.get("KVPOOL_NATS_CREDS")
    if explicit:
        return load_creds(explicit)
    found = creds_path(role)
    return load_creds(found) if found.exists() else None


def _private_dir(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def ensure_creds(folder: str | os.PathLike[str] | None = None) -> dict[Role, NatsCreds]:
    """Every role's credentials in `folder` (default `creds_dir()`), made now (random passwords,
    files 0600, folder 0700) where missing; existing ones are kept, so clients keep working."""
    where = creds_dir(folder)
    _private_dir(where)
    out: dict[Role, NatsCreds] = {}
    for role in ROLES:
        path = creds_path(role, where)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"user": f"kvpool-{role}", "password": secrets.token_urlsafe(32)}, f)
        os.chmod(path, 0o600)
        out[role] = load_creds(path)
    return out


def authorization(creds: dict[Role, NatsCreds]) -> str:
    """A nats-server `authorization` block: one user per role with that role's `PERMISSIONS`."""
    users = []
    for role, c in creds.items():
        perms = json.dumps(PERMISSIONS[role])
        users.append(f"    {{user: {json.dumps(c.user)}, password: {json.dumps(c.password)}, permissions: {perms}}}")
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"
