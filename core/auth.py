"""Who may talk to a worker: the pool token (where it is kept, how it is found), the challenge-response
both ends use to prove they hold it, Unix peer credentials, and the throttle on failed attempts.

- The token: explicit (`--token`, `ClientConfig.token`) > `KVPOOL_TOKEN` > the token file, which a
  worker creates at first start (`secrets.token_hex(32)`, 0600 in a 0700 folder): `KVPOOL_TOKEN_FILE`,
  else `<state dir>/token`. Clients of the same user find it there. `KVPOOL_NO_AUTH=1` (a worker's
  `--no-auth`) opts out on a single-user machine: loopback TCP then takes any local user's requests.
- The token never crosses the wire. The worker's pre-auth HELLO reply carries a random nonce; the
  client answers AUTH with its own nonce and HMAC-SHA256(token, nonce_w || nonce_c || "client"); the
  worker answers with HMAC-SHA256(token, nonce_w || nonce_c || "worker"). A peer that cannot prove
  the token learns nothing of it and is sent no data.
- Unix sockets: the kernel's SO_PEERCRED says who is on the other end; both ends accept only their
  own user (or root).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from pathlib import Path

from .config import default_state_dir
from .errors import ConfigError
from .sparse_log import SparseLog

__all__ = ["NONCE_BYTES", "AuthThrottle", "source_of", "find_token", "load_or_create_token", "no_auth_env", "peer_uid",
           "private_dir", "proof", "same_user", "token_path", "unix_socket_usable", "write_private"]

log = logging.getLogger("kvpool.auth")

NONCE_BYTES = 32
_TRUE = ("1", "true", "yes", "on")


def token_path() -> Path:
    """Where the pool token is kept: `KVPOOL_TOKEN_FILE`, else `<state dir>/token`."""
    env = os.environ.get("KVPOOL_TOKEN_FILE")
    return Path(env) if env else default_state_dir() / "token"


def no_auth_env() -> bool:
    """`KVPOOL_NO_AUTH=1`: this user opted out of tokens (single-user machine)."""
    return os.environ.get("KVPOOL_NO_AUTH", "").strip().lower() in _TRUE


def private_dir(path: Path, tighten: bool = False) -> Path:
    """`path` as a folder, made 0700 if it is missing, and so is each missing folder above it (whatever
    the umask). `tighten`: kvpool's own folder (the state folder, the SSD folder, NATS credentials): it
    must be a folder of this user's, reached by no link of another user's (ConfigError: another user who
    made it, or who can swap it, could plant credentials or links in it), and is made 0700 unless it is
    a shared one (sticky)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile
    if not path.is_dir():
        raise FileExistsError(errno.EEXIST, "exists and is not a folder", str(path))  # as mkdir says it
    if tighten:
        link = path.lstat()
        st = path.stat()
        if link.st_uid != os.getuid() or st.st_uid != os.getuid():
            what = f"a link of uid {link.st_uid}" if stat.S_ISLNK(link.st_mode) and link.st_uid != os.getuid() \
                else f"owned by uid {st.st_uid}"
            raise ConfigError(f"{path} is {what}; kvpool keeps its own files only in a folder of this user's "
                              f"(uid {os.getuid()})")
        if not st.st_mode & stat.S_ISVTX and stat.S_IMODE(st.st_mode) & 0o077:
            path.chmod(stat.S_IMODE(st.st_mode) & 0o700)
    return path


def write_private(path: Path, text: str, durable: bool = False) -> None:
    """Replace `path` with a 0600 file holding `text`, atomically, through a temporary file beside it that
    no link can redirect (a stale one, a crashed writer's, is removed first; a failed write's too).
    `durable`: on disk before the name points at it (a power loss leaves the old file or the new one)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # (a link is removed, not followed)
    _write_new(tmp, text.encode(), durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_new(path: Path, data: bytes, durable: bool) -> None:
    """Create `path` (0600; never through a link, never over a file) holding all of `data`, on disk first
    if `durable`. A write that fails (a full disk) leaves no half-written file behind."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, f"short write to {path}")
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def _read_token(path: Path) -> str | None:
    """The token in `path` if this user owns it and no one else can read it; else None (logged)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read the token file %s: %s", path, e)
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            log.warning("ignoring the token file %s: owned by uid %d with mode %o (need this user's, 0600)",
                        path, st.st_uid, stat.S_IMODE(st.st_mode))
            return None
        text = os.read(fd, 4096).decode(errors="replace").strip()
        return text or None
    finally:
        os.close(fd)


def load_or_create_token(path: Path) -> str:
    """The token in `path`, or a new one written there (0600, folder 0700) if there is none; two
    workers starting at once agree on one (the second finds the first's)."""
    found = _read_token(path)
    if found:
        return found
    token = secrets.token_hex(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        private_dir(path.parent, tighten=path.parent == default_state_dir())
        _write_new(tmp, (token + "\n").encode(), durable=True)
        try:
            os.link(tmp, path)  # fails if another worker made one meanwhile: use theirs
            log.info("created the pool token at %s (0600)", path)
        except FileExistsError:
            pass
    except OSError as e:  # a full or read-only disk: no token, and no half-written temporary left
        raise ConfigError(f"cannot create the token file {path}: {e.strerror or e}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    found = _read_token(path)
    if not found:
        raise ConfigError(f"the token file {path} exists but is not this user's 0600 file with a token in it")
    return found


def find_token() -> str | None:
    """A client's token when none was given: `KVPOOL_TOKEN`, else the token file; None with
    `KVPOOL_NO_AUTH=1` or when neither exists."""
    if no_auth_env():
        return None
    return os.environ.get("KVPOOL_TOKEN") or _read_token(token_path())


def proof(token: str, nonce_w: bytes, nonce_c: bytes, role: str) -> bytes:
    """HMAC-SHA256(token, nonce_w || nonce_c || role): what `role` ("client", "worker") shows."""
    key = token.encode("utf-8", "surrogatepass")
    return hmac.new(key, nonce_w + nonce_c + role.encode(), hashlib.sha256).digest()


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    return _peer_cred(sock)[1]


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    return _peer_cred(sock)[0]


def _peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(pid), int(uid), int(gid)


def same_user(uid: int) -> bool:
    """This process's user, or root (which can reach everything of it anyway)."""
    return uid in (os.getuid(), 0)


def unix_socket_usable(path: str) -> bool:
    """Whether this process may use the worker's Unix socket at `path` (and so its arena): a socket of
    this user's (or root's) that we may connect to. Another user's process on the worker's node (a
    tenant given its own Unix user) may not: it reaches the worker over TCP instead, with its token."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and same_user(st.st_uid) and os.access(path, os.W_OK)


def source_of(address: str) -> str:
    """What failed authentications are counted by: an IPv6 address's /64 network (one host may hold all
    of it), any other address as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # ("uid <n>" for a Unix peer)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class AuthThrottle:
    """Failed authentications by source (`source_of`): each failure is answered after a delay that
    doubles with the source's recent failures (BASE_S .. MAX_S; forgotten FORGET_S after the last one),
    so a guesser gets at most max_unauthenticated / MAX_S answers a second, while a client with the
    token, whose first try succeeds, is never delayed (and a success forgets nothing: one client with the
    token must not reset a guesser's delay on its network). Sources are kept in the order of their last
    failure (forgetting walks only those due) and at most MAX_SOURCES of them: past that a new source is
    answered at MAX_S (a crowd of one-time sources must not push a guesser out, back to BASE_S); a
    source's first failure is a warning, one a minute at most (`SparseLog`: no flood of the log)."""

    BASE_S = 0.05
    MAX_S = 2.0
    FORGET_S = 60.0
    MAX_SOURCES = 1 << 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, tuple[int, float]] = {}  # source -> (count, monotonic time of the last), oldest first
        self._first = SparseLog(log)

    def failed(self, address: str, why: str) -> float:
        """Count a failure from `address`; the seconds to wait before answering it."""
        now = time.monotonic()
        source = source_of(address)
        with self._lock:
            self._forget(now)
            if source not in self._failures and len(self._failures) >= self.MAX_SOURCES:
                return self.MAX_S  # (untracked: no room to count it)
            count = self._failures.pop(source, (0, now))[0] + 1
            self._failures[source] = (count, now)  # (to the end: the order of last failures)
        if count == 1:
            self._first.log("authentication failed from %s (%s); further failures from it are answered ever later "
                            "(counted in kvpool_auth_failures_total)", source, why)
        return float(min(self.MAX_S, self.BASE_S * 2 ** (count - 1)))

    def succeeded(self, address: str) -> None:
        source = source_of(address)
        with self._lock:
            had = self._failures.get(source)
        if had:
            log.info("%s authenticated, %d failed attempt(s) from %s in the last %.0f s", address, had[0], source,
                     self.FORGET_S)

    def _forget(self, now: float) -> None:
        """Drop the sources whose last failure is FORGET_S old: the first ones, in that order."""
        failures = self._failures
        while failures:
            source = next(iter(failures))
            count, last = failures[source]
            if now - last <= self.FORGET_S:
                return
            del failures[source]
            log.debug("forgot %d failed authentication(s) from %s", count, source)
