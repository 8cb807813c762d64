"""One connection to one worker: connect (over TLS when given a CA, `kvpool.core.tls`) and
authenticate, type its failures, and the control calls that are the same over TCP and shared memory
(exists, prefix, remove, clear, pin, stats).

`kvpool.core.transport` builds the two transports on it; they add how block bytes move.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np

from . import protocol as P
from . import request_ids
from .auth import NONCE_BYTES, find_token, no_auth_env, peer_uid, proof, same_user, token_path
from .buffers import byte_size
from .errors import (
    Abandoned,
    AuthError,
    BlockTooLarge,
    CapacityError,
    CorruptBlock,
    KVPoolError,
    NamespaceError,
    PoolTimeout,
    PoolUnavailable,
    ProtocolError,
    QuotaExceeded,
    StorageError,
)
from .pins import process_holder
from .pool_backend import MembersPredicate
from .records import PoolStats, WorkerInfo, WorkerStats
from .reply_spin import spin_us_from_env, spinning, unix_socket
from .tls import ca_file, client_context, server_name
from .versions import CLOCK, Change

__all__ = ["put_outcome", "item_error", "DEFAULT_MAX_BLOCK", "Busy", "Connection", "raise_item", "refuse_too_large",
           "send_pin", "pin_request", "sessions_entered", "max_block_of"]

log = logging.getLogger("kvpool.transport")

DEFAULT_MAX_BLOCK = 16 << 20
"""What `max_block` assumes of a worker whose HELLO does not say (an older worker)."""
GATE_WAIT_S = 1.0
"""The longest `close` or `abort` waits for a copy into reserved slots under way (`Connection._gate`)."""


class Busy(KVPoolError):
    """A message meant to go only on an idle connection (`Connection._session(idle=True)`) was not sent:
    the connection is in use, or not open (the caller sends it another way; no call of the API raises it)."""


_entered = threading.local()  # .count: sessions this thread has entered (`sessions_entered`)


def sessions_entered() -> int:
    """How many sessions (exchanges on an open connection) this thread has entered so far: a caller can
    tell whether a failed call got as far as sending anything."""
    return int(getattr(_entered, "count", 0))



def max_block_of(info: WorkerInfo) -> int:
    """The largest block worker `info` takes (DEFAULT_MAX_BLOCK where it does not say)."""
    return info.max_block or DEFAULT_MAX_BLOCK

class Connection:
    """A socket to one worker, one request at a time, reconnecting after a failure. A process forked
    from one that holds it starts without its socket (`_forked`)."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 5.0,
                 tls_ca: str | None = None, *, spin: bool = True) -> None:
        self.address = address
        self._spin = spin
        """The socket's receives spin for the worker's answers first (`kvpool.core.reply_spin`; not over
        TLS): a client's; a worker's own connections to its peers (catch-up) do not, nor read the setting."""
        self.token = token
        """The pool token; None: found when connecting (`kvpool.core.auth.find_token`)."""
        self.timeout_s = timeout_s
        self.tls_ca = None if self.unix else ca_file(tls_ca)
        """TCP: the CA file the worker's certificate must verify against (`tls_ca`, else `KVPOOL_TLS_CA`);
        None: clear text. Unix sockets never use TLS."""
        self._tls = client_context(self.tls_ca) if self.tls_ca else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timed_out_at = 0.0
        """When an exchange last ran past `timeout_s` (monotonic): calls that were waiting for the
        connection then fail at once, rather than each wait `timeout_s` more on a worker not answering."""
        self._gate = threading.Lock()
        """Held while this process copies into slots reserved on the connection (`ShmTransport.copying`);
        `close` and `abort` take it, so that no such copy lands once the worker may have freed them."""
        self._aborted = False
        self._shut = False
        """Closed for good (`shut`): a call raises PoolUnavailable, and no connection is made again."""
        self._unclosed: list[socket.socket] = []
        """Sockets shut down by `close` while an exchange was under way: closed when it ends (`_session`),
        not under it. Guarded, with `_exchanging`, by `_fd_lock`."""
        self._exchanging = False
        self._fd_lock = threading.Lock()
        _OPEN.add(self)
        self.generation = 0
        """How many connections this transport has closed: what the worker holds for a connection
        (leases, reservations) ends with it, and ids it gave are not those of the next one."""
        self.info = WorkerInfo(worker_id="")
        """The worker's HELLO reply, from the last (re)connect; empty before the first."""
        self.expect_id: str | None = None
        """The worker id the member entry this connection serves names (a cluster's): another worker
        answering at the address (one restarted there under a new id, while the old entry lingers) is
        PoolUnavailable, never taken for it: what it holds was not placed by that entry's ranking."""
        self.checksum_failures = 0
        """Blocks received from this worker whose bytes failed their checksum (each served as a miss)."""

    @property
    def unix(self) -> bool:
        return self.address.startswith("/")

    def _connect(self) -> socket.socket:
        try:
            if self.unix:
                sock = unix_socket(self._spin)
                try:
                    sock.settimeout(self.timeout_s)
                    sock.connect(self.address)
                except BaseException:
                    sock.close()
                    raise
            else:
                host, _, port = self.address.rpartition(":")
                # (the setting read before any socket is made: a bad one fails as the Unix path's does)
                spin_us = spin_us_from_env() if self._spin and self._tls is None else 0.0
                sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    if self._tls is not None:
                        sock = self._start_tls(sock, host, self._tls)
                    elif spin_us > 0:
                        sock = spinning(sock, self.timeout_s, spin_us)
                except BaseException:
                    sock.close()  # (a no-op for one TLS or the spin took over: they own its descriptor)
                    raise
        except OSError as e:
            raise PoolUnavailable(f"cannot connect to worker {self.address}: {e}") from e
        self._sock = sock
        try:
            self.info = WorkerInfo.from_dict(self._handshake(sock))
            if self.expect_id is not None and self.info.worker_id != self.expect_id:
                raise PoolUnavailable(f"the worker at {self.address} is {self.info.worker_id!r}, not "
                                      f"{self.expect_id!r}: that member entry is stale (sent nothing)")
        except BaseException:
            self.close()
            raise
        return sock

    def _start_tls(self, sock: socket.socket, host: str, context: ssl.SSLContext) -> ssl.SSLSocket:
        """The TLS handshake (within `timeout_s`): a worker whose certificate does not verify against
        our CA for the address dialled, or that does not speak TLS, is treated as absent (sent nothing)."""
        try:
            return context.wrap_socket(sock, server_hostname=server_name(host))
        except ssl.SSLCertVerificationError as e:
            raise PoolUnavailable(f"worker {self.address}: its TLS certificate does not verify against the CA "
                                  f"{self.tls_ca} ({e.verify_message}): treated as absent, sent nothing") from e
        except (ssl.SSLError, ConnectionError) as e:
            raise PoolUnavailable(f"worker {self.address}: no TLS handshake ({e}); a client with a CA "
                                  "(KVPOOL_TLS_CA) talks only to workers serving TLS (--tls-cert)") from e
        finally:
            sock.close()  # wrap_socket took its file descriptor (or failed): this closes nothing in use

    def _handshake(self, sock: socket.socket) -> dict[str, Any]:
        """Make sure of the worker before sending it anything but HELLO; its description.

        Unix socket: the kernel says the peer is this user (or root). TCP: both ends prove they hold
        the token (`kvpool.core.auth`); a worker that cannot is treated as absent (PoolUnavailable),
        and is sent neither the token nor data. A client with no token reaches only workers that ask
        for none (`--no-auth`); one with a token trusts no worker that does not prove it."""
        if self.unix:
            uid = peer_uid(sock)
            if not same_user(uid):
                raise PoolUnavailable(f"worker socket {self.address} is served by uid {uid}, not this user: "
                                      "treated as absent")
        try:
            hello = P.unpack_json(self._roundtrip(sock, P.Op.HELLO, P.pack_json({"holder": process_holder()})).meta)
        except (ProtocolError, ConnectionError) as e:
            if self.unix or self._tls is not None:
                raise
            raise PoolUnavailable(f"worker {self.address} did not answer HELLO ({e}); if it serves TLS "
                                  "(--tls-cert), give this client its CA (KVPOOL_TLS_CA, tls_ca)") from e
        token = self.token if self.token is not None else find_token()
        if "nonce" not in hello:
            if token and not self.unix and not no_auth_env():
                raise PoolUnavailable(f"worker {self.address} does not authenticate (--no-auth?) and so cannot "
                                      "prove it holds this client's token: treated as absent")
            return hello
        if not token:
            raise AuthError(f"worker {self.address} requires a token (KVPOOL_TOKEN, or the token file "
                            f"{token_path()} its user's workers make)")
        try:
            nonce_w = bytes.fromhex(str(hello["nonce"]))
        except ValueError as e:
            raise PoolUnavailable(f"worker {self.address} sent a malformed nonce") from e
        if len(nonce_w) != NONCE_BYTES:
            raise PoolUnavailable(f"worker {self.address} sent a nonce of {len(nonce_w)} bytes; {NONCE_BYTES} expected")
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        mine = proof(token, nonce_w, nonce_c, "client")
        answer = P.pack_json({"nonce": nonce_c.hex(), "proof": mine.hex()})
        info = P.unpack_json(self._roundtrip(sock, P.Op.AUTH, answer).meta)
        try:
            theirs = bytes.fromhex(str(info.pop("proof", "")))
        except ValueError:
            theirs = b""
        if not hmac.compare_digest(theirs, proof(token, nonce_w, nonce_c, "worker")):
            raise PoolUnavailable(f"worker {self.address} accepted this client's proof but could not prove it holds "
                                  "the token: treated as absent, sent no data")
        return info

    @contextmanager
    def _session(self, generation: int | None = None, *, idle: bool = False) -> Iterator[socket.socket]:
        """Hold the connection for one exchange; any transport failure drops it and is typed. `idle`:
        only if nothing else holds it and it is open (else `Busy`, and nothing is sent or opened).
        `generation`: the exchange belongs to that connection (e.g. the RELEASE of its leases): if it
        has closed since, PoolUnavailable, and no other connection is made or touched. A `close` from
        another thread during the exchange fails it too (PoolUnavailable), even where the shut-down
        socket could still read what had arrived: what the worker held for the connection has ended.

        Anything else that leaves an exchange drops the connection too (a KeyboardInterrupt or an
        exception from a signal handler while a reply is awaited, a caller's buffer that fails
        mid-receive): a reply, or part of one, may be unread, and the next request would find it in its
        place (its id refuses a whole stray reply, `request_ids`; part of one would be read as a header).
        The pool's own errors keep it: they are raised where the exchange is whole (a refused
        block, a destination too small, a stager's earlier failure, a tenant's request refused as outside
        its namespace with no other reply due), or close it above (a refused request's AuthError, a
        ProtocolError), or by the code that raised them with replies still due (`ShmTransport._put_frame`,
        `_get_frame`).

        A call that waited for the connection fails at once (PoolTimeout) if the call before it ran past
        `timeout_s` meanwhile: threads sharing a client behind a hung worker do not wait `timeout_s`
        each in turn. (One behind a long transfer that is answered in time waits for it.)"""
        asked = time.monotonic()
        if not self._lock.acquire(blocking=not idle):
            raise Busy(f"the connection to worker {self.address} is in use")
        try:
            if self._shut:
                raise PoolUnavailable("the client is closed")
            if self._timed_out_at > asked:
                raise PoolTimeout(f"worker {self.address} did not answer a call before this one within "
                                  f"{self.timeout_s} s", limit=self.timeout_s)
            if idle and (self._sock is None or self._aborted):
                raise Busy(f"no open connection to worker {self.address}")
            if generation is not None and generation != self.generation:
                raise PoolUnavailable(f"the connection to worker {self.address} closed meanwhile: the worker "
                                      "ended what this process held on it (leases, reserved slots)")
            with self._fd_lock:
                self._exchanging = True
            opened = self.generation
            sock: socket.socket | None = None
            try:
                # checked before connecting, and again once the socket is in place: `abort` either sees
                # the socket (and shuts it down) or is seen
                sock = None if self._aborted else self._sock or self._connect()
                if sock is None or self._aborted:
                    raise Abandoned(f"the connection to worker {self.address} was abandoned: a call on it ran past "
                                    "its deadline")
                _entered.count = getattr(_entered, "count", 0) + 1
                yield sock
                if self.generation != opened:  # a shut-down socket may still read what had arrived
                    raise PoolUnavailable(f"the connection to worker {self.address} was closed during the call")
            except (NamespaceError, StorageError):  # a refused request (a tenant's, or one a full disk would not
                # make durable): the connection stays where its exchange is whole
                if sock is None or request_ids.owed(sock):
                    self.close()
                raise
            except (AuthError, PoolUnavailable):
                self.close()
                raise
            except TimeoutError as e:
                self._timed_out_at = time.monotonic()
                self.close()
                raise PoolTimeout(f"worker {self.address} did not answer within {self.timeout_s} s",
                                  limit=self.timeout_s) from e
            except (ConnectionError, OSError, ProtocolError) as e:
                self.close()
                raise PoolUnavailable(f"worker {self.address}: {e}") from e
            except KVPoolError:
                raise  # the pool's own: raised where the exchange is whole (or by code that closed it)
            except BaseException:
                self.close()
                raise
            finally:
                with self._fd_lock:
                    self._exchanging = False
                    unclosed, self._unclosed = self._unclosed, []
                for s in unclosed:
                    s.close()
        finally:
            self._lock.release()

    @staticmethod
    def _roundtrip(sock: socket.socket, op: int, meta: bytes = b"", data: list[memoryview] | None = None) -> P.Frame:
        """One request and its reply on `sock`, the session's (a close in another thread meanwhile fails it
        as any socket error: typed by the session)."""
        P.send_frame(sock, op, meta, data=data)
        return P.recv_reply(sock, op)

    def call(self, op: int, meta: bytes = b"") -> P.Frame:
        with self._session() as sock:
            return self._roundtrip(sock, op, meta)

    def hello(self) -> WorkerInfo:
        """The worker's description, connecting first if need be."""
        with self._session():
            return self.info

    def shut(self) -> None:
        """Close for good: the connection, and every later call (PoolUnavailable, no new connection),
        as a closed client's calls are. (`close` only drops the connection: the next call opens another.)"""
        self._shut = True
        self.close()

    def abort(self) -> None:
        """From another thread: end the exchange in progress at once (its blocked send or receive fails)
        and every later one (no new connection is made). What a call abandoned past its deadline was
        doing stops here, so it can never write into (or send from) its caller's buffers afterwards, nor
        into slots it reserved (a copy under way ends first: `ShmTransport.copying`)."""
        with self._gated():
            self._aborted = True
            sock = self._sock
        if sock is not None:
            with suppress(OSError):  # the plain socket's shutdown, under TLS too (its state untouched)
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    @contextmanager
    def _gated(self) -> Iterator[None]:
        """`_gate` for `close` and `abort`, waited for at most GATE_WAIT_S: a part's copy takes
        milliseconds, but a close from a signal handler that interrupted this thread's own copy would
        otherwise wait for itself."""
        got = self._gate.acquire(timeout=GATE_WAIT_S)
        try:
            yield
        finally:
            if got:
                self._gate.release()

    def close(self) -> None:
        """Close the socket, shut down first: a call blocked on it in another thread (a read repair of a
        client closing) fails at once, where a close alone would leave it waiting out its timeout. That
        call closes the connection too, maybe at the same moment: each works on the socket it took. A
        copy into slots reserved on it ends first (`ShmTransport.copying`): the worker frees them at once."""
        with self._gated():
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                with suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                # An exchange under way in another thread fails at once on the shut-down socket; its file
                # descriptor is closed when that exchange ends, never under it: a system call about to
                # start there would otherwise land on whatever connection took the number meanwhile.
                with self._fd_lock:
                    if self._exchanging:
                        self._unclosed.append(sock)
                        sock = None
                if sock is not None:
                    sock.close()
            finally:
                self.generation += 1

    # ----- operations common to both transports ----------------------------------------------

    @property
    def max_block(self) -> int:
        return max_block_of(self.hello())

    def put_as_of(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float,
                  versions: Sequence[int] | None) -> list[int]:
        """Store blocks as of `versions` (stamped now if None); the indices of those not stored because
        the worker holds a version of their key as new or newer. Raises the first failed block's error."""
        raise NotImplementedError

    def put_statuses(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float,
                     versions: Sequence[int] | None) -> list[int]:
        """`put_as_of`, each block's outcome told rather than the first failure raised: its item status
        (`protocol.ITEM_OK`: stored; ITEM_SUPERSEDED; ITEM_STORAGE: stored, not durable; else the worker's
        refusal, `raise_item` says which). Errors of the whole call (no worker, a broken connection, a
        block too large for the worker, refused before any is sent) are raised as by `put_as_of`."""
        raise NotImplementedError

    def batch_put(self, keys: Sequence[bytes], buffers: Sequence[Any], pin_s: float = 0.0,
                  versions: Sequence[int] | None = None) -> None:
        """Store blocks; with `pin_s` > 0, pinned for that many seconds (see `batch_pin`). With
        `versions` (a replicated put's, a repair's), a block whose key the worker holds a newer version
        of is left as it is. Without, they are stamped now, and a block whose key the worker holds a
        version as new or newer of (another writer's clock runs ahead of this one's, or stamped in the
        same millisecond) is stamped again above it and put once more: a put made after another one
        was acknowledged replaces it."""
        status = self.put_statuses(keys, buffers, pin_s, versions)
        if not any(status):  # every block stored (ITEM_OK is 0): the usual batch
            return
        superseded = [i for i, st in enumerate(status) if st == P.ITEM_SUPERSEDED]
        again_failed: KVPoolError | None = None
        if superseded and versions is None:  # (before a failure is raised: the blocks held newer go again)
            again = [keys[i] for i in superseded]
            try:
                for j, st in enumerate(self.put_statuses(again, [buffers[i] for i in superseded], pin_s,
                                                         self.stamps_above(again))):
                    status[superseded[j]] = st
            except KVPoolError as e:  # (the first pass's refusals are told first)
                again_failed = e
        failed = [i for i, st in enumerate(status) if st not in (P.ITEM_OK, P.ITEM_SUPERSEDED)]
        refused = next((i for i in failed if status[i] != P.ITEM_STORAGE), None)
        if refused is not None:  # a block refused, else the re-put's failure, else one stored but not durable
            raise_item(status[refused], keys[refused], byte_size(buffers[refused]), self.max_block)
        if again_failed is not None:
            raise again_failed
        if failed:
            raise_item(status[failed[0]], keys[failed[0]], byte_size(buffers[failed[0]]), self.max_block)

    def stamps_above(self, keys: Sequence[bytes]) -> list[int]:
        """Fresh versions for `keys`, above the newest the worker knows of each (its block or removal)."""
        self.batch_versions(keys)  # merged into this process's clock
        return CLOCK.batch(len(keys))

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.batch_versions(keys)[0]

    def batch_versions(self, keys: Sequence[bytes]) -> tuple[list[bool], list[int]]:
        """Whether each block is present, and the newest version the worker knows of its key: its
        block's, else its removal's (0: neither)."""
        flags: list[bool] = []
        versions: list[int] = []
        for f in P.frames(len(keys)):
            n = f.stop - f.start
            meta = self.call(P.Op.EXISTS, P.pack_batch(list(keys[f]))).meta
            if len(meta) != 9 * n:
                raise PoolUnavailable(f"worker {self.address}: EXISTS reply of {len(meta)} bytes for {n} keys")
            flags += np.frombuffer(meta, dtype="<u1", count=n).astype(bool).tolist()
            versions += np.frombuffer(meta, dtype="<u8", count=n, offset=n).tolist()
        if versions:
            CLOCK.observe(max(versions))
        return flags, versions

    def batch_remove(self, keys: Sequence[bytes], versions: Sequence[int] | None = None) -> list[bool]:
        """Remove blocks: True where one was removed. `versions` as `batch_put`'s: without them, a key
        whose block is as new as the removal or newer is removed again as of a version above it."""
        outcomes = self.remove_as_of(keys, versions)
        if versions is None and P.SUPERSEDED in outcomes:
            idx = [i for i, o in enumerate(outcomes) if o == P.SUPERSEDED]
            again = [keys[i] for i in idx]
            for i, o in zip(idx, self.remove_as_of(again, self.stamps_above(again))):
                outcomes[i] = o
        return [o == P.REMOVED for o in outcomes]

    def remove_as_of(self, keys: Sequence[bytes], versions: Sequence[int] | None) -> list[int]:
        """Remove blocks as of `versions` (stamped now if None): each key's outcome, P.REMOVED, 0 (none
        held) or P.SUPERSEDED (a block as new or newer is held, and stays)."""
        stamps = np.asarray(versions, dtype="<u8") if versions is not None else CLOCK.batch_array(len(keys))
        out: list[int] = []
        for f in P.frames(len(keys)):
            reply = self.call(P.Op.REMOVE, P.pack_batch(list(keys[f]), stamps[f]))
            if len(reply.meta) != f.stop - f.start:
                raise PoolUnavailable(f"worker {self.address}: REMOVE reply of {len(reply.meta)} bytes for "
                                      f"{f.stop - f.start} keys")
            out += np.frombuffer(reply.meta, dtype="<u1").tolist()
        return out

    def changes(self, since_ms: int, from_seq: int = 0) -> tuple[list[Change], int, int]:
        """The changes the worker accepted since `since_ms` (unix ms), from `from_seq` on: (changes,
        the sequence number to ask from next or -1, the time since which its log is complete)."""
        meta = self.call(P.Op.CHANGES, P.pack_json({"since_ms": since_ms, "from_seq": from_seq})).meta
        if len(meta) < 16:
            raise PoolUnavailable(f"worker {self.address}: CHANGES reply of {len(meta)} bytes")
        covered = int(np.frombuffer(meta, dtype="<u8", count=1)[0])
        nxt = int(np.frombuffer(meta, dtype="<i8", count=1, offset=8)[0])
        try:
            return P.unpack_changes(meta[16:]), nxt, covered
        except ProtocolError as e:
            raise PoolUnavailable(f"worker {self.address}: {e}") from e

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        total = 0
        for f in P.frames(len(keys)):
            n = P.unpack_json(self.call(P.Op.PREFIX, P.pack_batch(list(keys[f]))).meta).get("n")
            if type(n) is not int or not 0 <= n <= f.stop - f.start:
                raise PoolUnavailable(f"worker {self.address} answered a prefix of {f.stop - f.start} keys with {n!r}")
            total += n
            if n < f.stop - f.start:
                break
        return total

    def clear(self, prefix: bytes | None = None) -> None:
        self.call(P.Op.CLEAR, P.pack_batch([prefix]) if prefix is not None else b"")

    def supersede(self, keys: Sequence[bytes], versions: Sequence[int], *, idle: bool = False) -> None:
        """Tell a worker below the owners of `keys` (`kvpool.core.succession`) that they took a put or
        remove as of `versions`: it drops its older blocks of them (`ReplicaState.supersede`). One way:
        nothing waits for the worker; the requests sent after it on this connection are handled after it.
        `idle`: only on this connection open and unused now (else `Busy`, nothing sent)."""
        stamps = np.asarray(versions, dtype="<u8")
        with self._session(idle=idle) as sock:
            for f in P.frames(len(keys)):
                P.send_frame(sock, P.Op.SUPERSEDE, P.pack_batch(list(keys[f]), stamps[f]))

    def batch_pin(self, keys: Sequence[bytes], pin_s: float) -> None:
        """Pin blocks for `pin_s` seconds (<= 0: unpin). One way: nothing waits for the worker."""
        with self._session() as sock:
            for f in P.frames(len(keys)):
                send_pin(sock, keys[f], pin_s)

    def stats(self) -> PoolStats:
        worker = WorkerStats.from_dict(P.unpack_json(self.call(P.Op.STATS).meta))
        return PoolStats.of_workers({worker.info.worker_id: worker})

    def members(self) -> dict[str, WorkerInfo]:
        info = self.hello()
        return {info.worker_id: info}

    def wait_for_members(self, predicate: MembersPredicate, timeout_s: float) -> bool:
        return predicate(self.members())  # one worker, for as long as the connection: nothing to wait for


_OPEN: weakref.WeakSet[Connection] = weakref.WeakSet()
"""Every Connection of this process, for `_forked`."""


def _forked() -> None:
    """In a forked child: let go of the parent's sockets, each connection to reconnect when used. Shared,
    the two processes' requests would interleave on one socket; and a child that outlives its parent
    would keep the parent's leases and reserved slots held at the worker (it sees no close)."""
    for conn in list(_OPEN):
        conn._lock = threading.Lock()  # another thread of the parent may have held it at the fork
        conn._gate = threading.Lock()
        conn._fd_lock = threading.Lock()
        conn._exchanging = False
        for s in conn._unclosed:  # (the child's copies)
            s.close()
        conn._unclosed = []
        if conn._sock is not None:
            conn._sock.close()  # the child's copy only: the parent's socket stays open
            conn._sock = None
            conn.generation += 1


os.register_at_fork(after_in_child=_forked)


def put_outcome(status: Sequence[int], keys: Sequence[bytes], lens: Sequence[int], max_block: int) -> list[int]:
    """The indices of a put's blocks the worker did not store because it holds a version as new or newer
    (ITEM_SUPERSEDED); raises the error of the first block that failed otherwise (`raise_item`)."""
    failed = next((i for i, st in enumerate(status) if st and st != P.ITEM_SUPERSEDED), None)
    if failed is not None:
        raise_item(int(status[failed]), keys[failed], lens[failed], max_block)
    return [i for i, st in enumerate(status) if st == P.ITEM_SUPERSEDED]


def raise_item(status: int, key: bytes, size: int, max_block: int) -> None:
    """Raise the error of a put's per-block status, if it is one (`item_error`)."""
    error = item_error(status, key, size, max_block)
    if error is not None:
        raise error


def item_error(status: int, key: bytes, size: int, max_block: int) -> KVPoolError | None:
    """The error of a put's per-block status; None for a block stored (ITEM_OK) or not stored because the
    worker holds a version as new or newer (ITEM_SUPERSEDED). A block the worker found corrupt on arrival
    (damaged on the way) is not stored: CorruptBlock, and the caller may put it again."""
    if status in (P.ITEM_OK, P.ITEM_SUPERSEDED):
        return None
    if status == P.ITEM_TOO_LARGE:
        return BlockTooLarge(f"block {key[:24]!r} is {size} bytes; the worker's max block is {max_block}",
                             key=key, size=size, limit=max_block)
    if status == P.ITEM_FULL:
        return CapacityError(f"worker has no room for block {key[:24]!r} ({size} bytes)", key=key, size=size)
    if status == P.ITEM_QUOTA:
        return QuotaExceeded(f"block {key[:24]!r} ({size} bytes) would take this token's tenant past its quota "
                             "of bytes stored on the worker; nothing was stored under it", key=key, size=size)
    if status == P.ITEM_STORAGE:
        return StorageError(f"block {key[:24]!r} is stored, but a full disk on the worker kept the older SSD copy "
                            "it replaces: a crash would bring that back", key=key, size=size)
    if status == P.ITEM_CORRUPT:
        return CorruptBlock(f"block {key[:24]!r} arrived corrupt at the worker (checksum mismatch); nothing "
                            "was stored under it", key=key, size=size)
    # no status a worker sends: whether the block was stored is not known
    return ProtocolError(f"the worker answered the put of block {key[:24]!r} with status {status}, which "
                         "no worker sends")


def refuse_too_large(keys: Sequence[bytes], lens: Sequence[int], max_block: int) -> None:
    """BlockTooLarge for the batch's first block over `max_block`. Checked before any block of the batch
    is sent, so a batch with such a block stores none (as the embedded cache's), where the worker's
    refusals found on arrival (`raise_item`) fail their own blocks only."""
    if lens and max(lens) > max_block:
        i = next(i for i, n in enumerate(lens) if n > max_block)
        raise_item(P.ITEM_TOO_LARGE, keys[i], lens[i], max_block)


def send_pin(sock: socket.socket, keys: Sequence[bytes], pin_s: float) -> None:
    """A PIN frame; the worker handles a connection's frames in order, so a put sent after it on the
    same connection commits its blocks pinned."""
    P.send_frame(sock, *pin_request(keys, pin_s))


def pin_request(keys: Sequence[bytes], pin_s: float) -> tuple[int, bytes]:
    """The PIN request (op, metadata) of `send_pin`, for `protocol.send_frames`."""
    return P.Op.PIN, P.pack_batch(list(keys), np.full(len(keys), pin_s, dtype="<f8"))
