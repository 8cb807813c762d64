"""NATS users per role, and where processes find theirs: what `kvpool up` secures its nats-server with.

Roles: `worker` writes membership and block events; `client` reads membership and events and uses
existing streams; `admin` may do anything (create and delete streams). Each role's credentials are a
JSON file, 0600, in `<state dir>/nats/` (0700): an nkey, `{"user": <label>, "nkey_seed": "SU..."}`
(what `kvpool up` makes: the client signs the server's nonce, no secret crosses the wire and the
server's config holds only public keys), or a user and password, `{"user": ..., "password": ...}`
(files of older versions, and `ensure_creds(nkeys=False)`). A process finds its role's file there,
or uses the one file named by `KVPOOL_NATS_CREDS` (hand a machine only the role it needs). A URL with
credentials in it (`nats://user:pass@host`) is used as it is.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Literal

from .auth import private_dir
from .config import default_state_dir
from .errors import ConfigError

__all__ = ["Role", "ROLES", "MEMBERS_BUCKET", "EVENTS_SUBJECTS", "STREAM_SUBJECTS", "DEAD_LETTER_SUBJECTS",
    "PERMISSIONS", "NatsCreds", "creds_dir", "creds_path", "load_creds", "find_creds", "ensure_creds", "authorization",
    "redacted_url", "new_user_seed"]

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
_WORKER_JS = [*(c for c in _USE_JS if not c.startswith("$JS.API.STREAM.PURGE")),
              f"$JS.API.STREAM.CREATE.KV_{MEMBERS_BUCKET}", f"$JS.API.STREAM.UPDATE.KV_{MEMBERS_BUCKET}",
              "$JS.API.STREAM.CREATE.KVPOOL_EVENTS"]
"""A worker's JetStream calls: those of `_USE_JS` but purges, and the configuration of its own two streams
(the member bucket, which it creates and raises to its TTL; the block events stream, which it creates):
no other stream's (it could delete a user's stream, or make one that republishes into any subject)."""

PERMISSIONS: dict[Role, dict[str, dict[str, list[str]]]] = {
    "worker": {"publish": {"allow": [*_WORKER_JS, f"$KV.{MEMBERS_BUCKET}.>", EVENTS_SUBJECTS, "$JS.ACK.>",
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
    """A NATS user with a password, or an nkey (`seed`; `user` is then only a label for messages);
    `path` is the file they came from (for messages), if any."""

    user: str
    password: str | None = dataclasses.field(default=None, repr=False)
    path: str | None = None
    seed: str | None = dataclasses.field(default=None, repr=False)
    """An nkey user seed (`SU...`, base32): signs the server's nonce at connect; its public key
    (`public_key`) is what the server's config lists."""

    @property
    def public_key(self) -> str:
        """The nkey's public key (`U...`); ConfigError for a password user or a malformed seed."""
        if self.seed is None:
            raise ConfigError(f"NATS user {self.user!r} ({self.path or 'given'}) has a password, not an nkey")
        import nkeys

        try:
            kp = nkeys.from_seed(bytearray(self.seed.encode()))
        except (nkeys.NkeysError, ValueError, binascii.Error) as e:
            raise ConfigError(f"NATS credentials {self.path or self.user!r}: not an nkey seed ({e})") from e
        try:
            return str(kp.public_key.decode())
        finally:
            kp.wipe()

    def connect_options(self) -> dict[str, str]:
        """nats-py `connect` keywords that authenticate as this user."""
        if self.seed is not None:
            return {"nkeys_seed_str": self.seed}
        return {"user": self.user, "password": self.password or ""}


def creds_dir(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where `kvpool up` keeps the NATS credentials: `<state dir>/nats`."""
    return Path(state_dir) if state_dir is not None else default_state_dir() / "nats"


def creds_path(role: Role, folder: str | os.PathLike[str] | None = None) -> Path:
    """The credentials file of `role` in `folder` (default `creds_dir()`)."""
    return creds_dir(folder) / f"{role}.json"


def load_creds(path: str | os.PathLike[str]) -> NatsCreds:
    """The nkey seed, or user and password, in a credentials file; ConfigError naming the file if it is
    not one, or if it is a link, or another user's, or readable by others (as ssh does of a key: whoever
    could write it picks the identity this process logs in as)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"NATS credentials file {path}: {e.strerror or e}"
                          + (" (a link: name the file itself)" if e.errno == errno.ELOOP else "")) from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(f"NATS credentials file {path} is owned by uid {st.st_uid} with mode "
                              f"{stat.S_IMODE(st.st_mode):o}: it must be this user's (uid {os.getuid()}) and 0600 "
                              f"(chmod 600 {path})")
        raw = f.read(1 << 20)
    try:
        data: Any = json.loads(raw)
        if "nkey_seed" in data:
            creds = NatsCreds(str(data.get("user", "nkey")), None, str(path), seed=str(data["nkey_seed"]))
            creds.public_key  # noqa: B018 - a malformed seed is the file's error, said now, not at connect
            return creds
        return NatsCreds(str(data["user"]), str(data["password"]), str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"NATS credentials file {path}: {type(e).__name__}: {e} "
                          '(expected JSON {"user": ..., "nkey_seed": ...} or {"user": ..., "password": ...})') from e


def redacted_url(url: str) -> str:
    """A NATS URL (or a comma-separated list of them) as messages and logs show it: a password in it
    (`user:password@`), or a token (`token@`), replaced by ***, so that an error carries no credentials."""
    def one(u: str) -> str:
        scheme, sep, rest = u.partition("://")
        if not sep:  # (nats-py takes `user:password@host` without a scheme too)
            scheme, rest = "", u
        who, at, where = rest.rpartition("@")
        if not at:
            return u
        user = f"{who.split(':', 1)[0]}:" if ":" in who else ""
        return f"{scheme}{sep}{user}***@{where}"
    return ",".join(one(u) for u in url.split(","))


def find_creds(role: Role, path: str | os.PathLike[str] | None = None) -> NatsCreds | None:
    """The credentials to connect as `role`: the file `path` if given, else the one named by
    `KVPOOL_NATS_CREDS`, else `<state dir>/nats/<role>.json` if it exists; None when there are none
    (an unsecured server, or one that will refuse us: see `nats_connect`)."""
    explicit = path or os.environ.get("KVPOOL_NATS_CREDS")
    if explicit:
        return load_creds(explicit)
    found = creds_path(role)
    return load_creds(found) if os.path.exists(found) else None  # False too where we may not look (another user's)




_PREFIX_SEED = 18 << 3  # nkeys' version bytes: base32 "S..." (a seed) of a "U..." (a user)
_PREFIX_USER = 20 << 3


def _crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the checksum nkeys appends to every encoded key."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
    return crc


def new_user_seed() -> str:
    """A new nkey user seed (`SU...`): 32 random bytes, encoded as nkeys encodes them."""
    raw = bytes([_PREFIX_SEED | (_PREFIX_USER >> 5), (_PREFIX_USER & 31) << 3]) + secrets.token_bytes(32)
    return base64.b32encode(raw + _crc16(raw).to_bytes(2, "little")).decode().rstrip("=")


def ensure_creds(folder: str | os.PathLike[str] | None = None, *, nkeys: bool = True) -> dict[Role, NatsCreds]:
    """Every role's credentials in `folder` (default `creds_dir()`), made now where missing (files
    0600, folder 0700): an nkey seed each, or with `nkeys=False` a random password. Existing files
    are kept, whichever kind, so clients keep working."""
    where = private_dir(creds_dir(folder), tighten=True)  # ConfigError if it is another user's
    out: dict[Role, NatsCreds] = {}
    for role in ROLES:
        path = creds_path(role, where)
        if not os.path.lexists(path):
            secret = {"nkey_seed": new_user_seed()} if nkeys else {"password": secrets.token_urlsafe(32)}
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"user": f"kvpool-{role}", **secret}, f)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(f"NATS credentials file {path} is not a 0600 file of this user's (uid {st.st_uid}, "
                              f"mode {stat.S_IMODE(st.st_mode):o}): not trusted as the server's users")
        out[role] = load_creds(path)
    return out


def authorization(creds: dict[Role, NatsCreds]) -> str:
    """A nats-server `authorization` block: one user per role with that role's `PERMISSIONS`; an
    nkey user is listed by its public key only."""
    users = []
    for role, c in creds.items():
        perms = json.dumps(PERMISSIONS[role])
        who = (f"nkey: {json.dumps(c.public_key)}" if c.seed is not None else
               f"user: {json.dumps(c.user)}, password: {json.dumps(c.password)}")
        users.append(f"    {{{who}, permissions: {perms}}}")
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"
