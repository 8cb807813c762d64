"""Bad answers from a worker: a TCP worker that holds the pool token (so the client trusts it and sends
it data), or a same-node one with a real shared-memory arena, answers each request with what hypothesis
draws: a frame of another op or an error status, metadata of a wrong length or random bytes (slots in and
out of the arena), data its header does not announce or announces and never sends, bytes that are no
frame, a closed connection, or silence. Every client call returns or raises a KVPoolError within a
bounded time; none hangs, crashes, raises anything else, or touches memory outside the arena."""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.core import protocol as P
from kvpool.core.auth import NONCE_BYTES, proof
from kvpool.core.blocks import checksum
from kvpool.core.connection import Connection
from kvpool.core.errors import KVPoolError, PoolUnavailable
from kvpool.core.tiers.dram import DramArena
from kvpool.core.transport import ShmTransport, TcpTransport

TOKEN = "s3cret"
TIMEOUT_S = 0.3
EXAMPLES = 200
BOUND_S = 4 * TIMEOUT_S + 1.0
"""A call makes a few exchanges at most (the handshake's two, then its own), each bounded by TIMEOUT_S."""


@dataclass(frozen=True)
class Reply:
    """What the worker does with one request: `how` is "frame" (op, status, meta, then `data`, under a
    header that announces `claim` data bytes, or exactly those sent if None), "raw" (`data` alone, no
    header), "close" or "silence"."""

    how: str
    op: int | None = None  # None: the request's own op
    status: int = 0
    meta: bytes = b""
    data: bytes = b""
    claim: int | None = None
    id_shift: int = 0  # the reply carries the request's id plus this (not 0: another request's reply)


class LyingWorker:
    """A TCP listener that completes the pool's handshake (it proves it holds the token) and then answers
    each request of a connection with the next of `replies` (once they run out: it closes). With `arena`
    (a DramArena), a same-node worker on a Unix socket in `unix_dir` instead, whose HELLO names that arena."""

    def __init__(self, arena: DramArena | None = None, unix_dir: Path | None = None) -> None:
        self.arena = arena
        if arena is None:
            self._listener = socket.create_server(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        else:
            assert unix_dir is not None
            self.address = str(unix_dir / "liar.sock")
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self.address)
            self._listener.listen()
        self.replies: list[Reply] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not, on Linux)
        self._listener.close()
        self._thread.join(5)
        assert not self._thread.is_alive()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, list(self.replies)), daemon=True).start()

    def _serve(self, conn: socket.socket, replies: list[Reply]) -> None:
        conn.settimeout(10)
        try:
            with conn:
                nonce_w = secrets.token_bytes(NONCE_BYTES)
                hello = P.recv_frame(conn)
                if self.arena is not None:  # same node: the kernel vouches for the peer's user
                    P.send_frame(conn, P.Op.HELLO, P.pack_json({
                        "worker_id": "liar", "unix": self.address, "max_block": 1 << 20, "max_reserve": 8 << 20,
                        "arena": self.arena.name, "arena_size": self.arena.length, "transports": ["shm"]}),
                        req_id=hello.req_id)
                else:
                    P.send_frame(conn, P.Op.HELLO, P.pack_json({"auth": True, "nonce": nonce_w.hex()}),
                                 req_id=hello.req_id)
                    auth = P.recv_frame(conn)
                    nonce_c = bytes.fromhex(json.loads(auth.meta)["nonce"])
                    info = {"worker_id": "liar", "tcp": self.address, "max_block": 1 << 20, "auth": True,
                            "proof": proof(TOKEN, nonce_w, nonce_c, "worker").hex()}
                    P.send_frame(conn, P.Op.AUTH, P.pack_json(info), req_id=auth.req_id)
                for reply in replies:
                    frame = P.recv_frame(conn)
                    P.drain(conn, frame.data_len)
                    while frame.op in P.ONE_WAY:  # one-way requests (a same-node get's RELEASE, ABORT, PIN)
                        frame = P.recv_frame(conn)
                        P.drain(conn, frame.data_len)
                    if reply.how == "close":
                        return
                    if reply.how == "silence":
                        conn.recv(1)  # until the client gives up and closes (or the timeout above)
                        return
                    if reply.how == "raw":
                        conn.sendall(reply.data)
                        continue
                    op = frame.op if reply.op is None else reply.op
                    claim = len(reply.data) if reply.claim is None else reply.claim
                    rid = (frame.req_id + reply.id_shift) % (1 << 32)
                    conn.sendall(P.header(op, reply.status, rid, reply.meta, claim) + reply.meta + reply.data)
        except (OSError, ValueError, KeyError, KVPoolError):
            pass  # the client hung up on us: what it should do with a liar


@pytest.fixture(scope="module")
def liar() -> Iterator[LyingWorker]:
    w = LyingWorker()
    yield w
    w.close()


ARENA = 8 << 20


@pytest.fixture(scope="module")
def shm_liar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LyingWorker]:
    arena = DramArena(ARENA, slab_size=1 << 20)
    w = LyingWorker(arena, tmp_path_factory.mktemp("liar"))
    yield w
    w.close()
    arena.close()


def _meta(n_max: int = 4) -> st.SearchStrategy[bytes]:
    """Metadata: random bytes, a column's worth for a few keys, or JSON."""
    return st.one_of(
        st.binary(max_size=200),
        st.builds(lambda n, w, b: b[:n * w].ljust(n * w, b"\xff"), st.integers(0, n_max),
                  st.sampled_from([1, 8, 9, 16, 17, 24, 32, 40, 48]), st.binary(max_size=400)),
        st.sampled_from([b"{}", b'{"error": "no"}', b'{"n": -1}', b'{"n": 99}', b"[]", b"null", b"{"]),
    )


def _get_reply(sizes: list[int], right_sums: bool, extra: int) -> Reply:
    """A GET reply for these block sizes (< 0: a miss), its checksums right or not, its data `extra` bytes
    off what the sizes say."""
    body = [bytes([i]) * max(s, 0) for i, s in enumerate(sizes)]
    sums = [checksum(b) if right_sums else 0 for b in body]
    meta = np.array(sizes, "<i8").tobytes() + np.array(sums, "<u8").tobytes() + np.zeros(len(sizes), "<u8").tobytes()
    data = b"".join(body)
    return Reply("frame", meta=meta, data=data[:len(data) + extra] if extra < 0 else data + b"\0" * extra)


GET_REPLY = st.builds(_get_reply, st.lists(st.sampled_from([-1, 0, 1, 4096, 4097, 1 << 20]), min_size=1, max_size=3),
                      st.booleans(), st.sampled_from([0, 0, 1, -1, 100]))
REPLY = st.one_of(
    GET_REPLY,
    st.builds(Reply, how=st.just("frame"), op=st.none() | st.integers(0, 255),
              status=st.sampled_from([0, 0, 0, 1, 2, 3, 4, 255]), meta=_meta(), data=st.binary(max_size=5000),
              claim=st.none() | st.integers(0, 1 << 20)),
    st.builds(Reply, how=st.just("raw"), data=st.binary(min_size=1, max_size=64)),
    st.builds(Reply, how=st.just("close")),
    st.builds(Reply, how=st.sampled_from(["frame", "frame", "frame", "silence"]), meta=_meta()),
)
OPS = ["get", "put", "exists", "remove", "prefix", "stats", "lease"]


def _call(t: Connection, op: str, n: int) -> None:
    keys = [f"k{i}".encode() for i in range(n)]
    if op == "get":
        out = t.batch_get_into(keys, [bytearray(4096) for _ in keys])
        assert all(-1 <= s <= 4096 for s in out)
    elif op == "put":
        t.batch_put(keys, [bytes([i]) * 1000 for i in range(n)])
    elif op == "exists":
        assert len(t.batch_exists(keys)) == n
    elif op == "remove":
        assert len(t.batch_remove(keys)) == n
    elif op == "prefix":
        assert 0 <= t.prefix_match(keys) <= n
    elif op == "stats":
        t.stats()
    else:
        with t.batch_lease(keys) as views:
            assert len(views) == n


def _call_bounded(t: Connection, op: str, n: int) -> None:
    """`_call`, which may raise only a KVPoolError, and must end within BOUND_S either way."""
    start = time.monotonic()
    try:
        _call(t, op, n)
    except KVPoolError:
        pass
    finally:
        t.close()
    assert time.monotonic() - start < BOUND_S, f"{op} took {time.monotonic() - start:.1f} s"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(OPS), n=st.integers(1, 3), replies=st.lists(REPLY, min_size=0, max_size=3))
def test_every_call_returns_or_raises_typed_within_its_deadline(liar: LyingWorker, op: str, n: int,
                                                                replies: list[Reply]) -> None:
    liar.replies = replies
    _call_bounded(TcpTransport(liar.address, token=TOKEN, timeout_s=TIMEOUT_S), op, n)


def test_the_liar_is_trusted_when_it_tells_the_truth(liar: LyingWorker) -> None:
    """The fixture completes the handshake (else every example above would only test a refusal)."""
    liar.replies = [Reply("frame", meta=P.pack_json({"n": 2}))]
    t = TcpTransport(liar.address, token=TOKEN, timeout_s=TIMEOUT_S)
    try:
        assert t.prefix_match([b"a", b"b", b"c"]) == 2
    finally:
        t.close()


@pytest.mark.parametrize("statuses", [b"", b"\x00", b"\x00\x00\x00", b"\x07\x00", b"\xff\x00"],
                         ids=["none", "short", "long", "unknown", "a-miss"])
def test_a_put_answered_wrong_is_not_taken_as_stored(liar: LyingWorker, statuses: bytes) -> None:
    """A PUT of two blocks answered with too few or too many statuses, or one no worker sends for a put,
    says nothing of whether the blocks were stored: an error, never a quiet success."""
    liar.replies = [Reply("frame", meta=statuses)]
    t = TcpTransport(liar.address, token=TOKEN, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(KVPoolError, match="statuses for 2 blocks|no worker sends"):
            t.batch_put([b"a", b"b"], [b"x" * 100, b"y" * 100])
    finally:
        t.close()


I64 = st.sampled_from([0, 4096, ARENA - 4096, ARENA - 1, ARENA, 1 << 40, -1, -2, -3, -4, -5, -6, -(1 << 63)]) | \
    st.integers(-(1 << 63), (1 << 63) - 1)


def _columns(n_cols: int) -> st.SearchStrategy[bytes]:
    """A same-node reply of `n_cols` int64 columns for 1-3 keys: offsets, sizes and the like, in and out
    of the arena."""
    return st.integers(1, 3).flatmap(lambda n: st.lists(I64, min_size=n * n_cols, max_size=n * n_cols)).map(
        lambda xs: b"".join(x.to_bytes(8, "little", signed=True) for x in xs))


SHM_REPLY = st.one_of(
    REPLY,
    st.builds(Reply, how=st.just("frame"), meta=_columns(1)),  # an ALLOC's offsets
    st.builds(Reply, how=st.just("frame"), meta=_columns(5)),  # a LEASE's ids, offsets, sizes, sums, versions
    st.builds(Reply, how=st.just("frame"), meta=st.integers(1, 3).flatmap(  # a COMMIT's statuses
        lambda n: st.binary(min_size=n, max_size=n))),
)


@pytest.mark.usefixtures("arena_only")  # (the arena's replies, for small batches too)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(["get", "put", "lease"]), n=st.integers(1, 3),
       replies=st.lists(SHM_REPLY, min_size=0, max_size=4))
def test_a_same_node_call_returns_or_raises_typed_and_touches_only_the_arena(
        shm_liar: LyingWorker, op: str, n: int, replies: list[Reply]) -> None:
    """As over TCP; and whatever slots the worker names, the client copies into and out of its arena
    only (a slot outside it is the worker's ProtocolError, never a write or read past the mapping)."""
    shm_liar.replies = replies
    _call_bounded(ShmTransport(shm_liar.address, timeout_s=TIMEOUT_S), op, n)


@pytest.mark.usefixtures("arena_only")  # (the arena's replies, for small batches too)
def test_the_same_node_liar_is_trusted_when_it_tells_the_truth(shm_liar: LyingWorker) -> None:
    """Its arena is mapped and its slots used (else every example above would stop at the handshake)."""
    assert shm_liar.arena is not None
    offset, data = 3 * 4096, bytes(range(256)) * 16
    lease = [1, offset, len(data), checksum(data), 7]
    shm_liar.replies = [Reply("frame", meta=np.array([offset], "<i8").tobytes()), Reply("frame", meta=b"\x00"),
                        Reply("frame", meta=np.array(lease, "<u8").tobytes()), Reply("silence")]
    t = ShmTransport(shm_liar.address, timeout_s=TIMEOUT_S)
    try:
        t.batch_put([b"k"], [data])
        assert bytes(shm_liar.arena.buf[offset:offset + len(data)]) == data  # the client wrote it there
        out = bytearray(4096)
        assert t.batch_get_into([b"k"], [out]) == [len(data)] and bytes(out) == data
    finally:
        t.close()


@pytest.mark.parametrize("shift", [0, -1, 1], ids=["its-own", "the-request-before", "a-later-request"])
def test_a_reply_is_taken_only_for_the_request_it_answers(liar: LyingWorker, shift: int) -> None:
    """A GET reply right in every way (sizes, data, checksums) but carrying another request's id (one
    left unread on the connection, one sent twice) is not this request's answer: nothing lands in the
    caller's buffer and the connection is dropped (PoolUnavailable). With its own id it is read."""
    data = bytes([0]) * 4096
    liar.replies = [dataclasses.replace(_get_reply([4096], True, 0), id_shift=shift)]
    t = TcpTransport(liar.address, token=TOKEN, timeout_s=TIMEOUT_S)
    out = bytearray(b"\xaa" * 4096)
    try:
        if shift == 0:
            assert t.batch_get_into([b"k"], [out]) == [4096] and bytes(out) == data
            return
        with pytest.raises(PoolUnavailable, match="reply to request"):
            t.batch_get_into([b"k"], [out])
        assert bytes(out) == b"\xaa" * 4096
    finally:
        t.close()


@pytest.mark.parametrize("extra", [1, 100])
def test_a_get_reply_whose_data_disagrees_with_its_sizes_drops_the_connection(liar: LyingWorker, extra: int) -> None:
    """Data past what the sizes say would be read as the start of the next reply: the frame is refused
    (PoolUnavailable) and the connection dropped, before anything is read out of step."""
    liar.replies = [_get_reply([4096], True, extra), _get_reply([4096], True, 0)]
    t = TcpTransport(liar.address, token=TOKEN, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(PoolUnavailable, match="data bytes for blocks of"):
            t.batch_get_into([b"k0"], [bytearray(4096)])
        assert t._sock is None
    finally:
        t.close()


def test_a_close_during_an_exchange_ends_it_at_once_and_frees_its_descriptor_after(
        liar: LyingWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread's exchange (a read repair as its client closes) fails at once on the shut-down
    socket, but the descriptor stays its socket's until that exchange ends: a system call about to start
    there would otherwise land on whatever connection took the number meanwhile (a "Bad file descriptor"
    from such a thread showed it happens near the close). The reader here is held just before it reads
    the reply. A close with no exchange under way frees the descriptor at once."""
    liar.replies = [Reply("silence")]
    t = TcpTransport(liar.address, token=TOKEN, timeout_s=10)
    t.hello()
    sock = t._sock
    assert sock is not None
    fd, inode = sock.fileno(), os.fstat(sock.fileno()).st_ino
    about_to_read, go = threading.Event(), threading.Event()
    recv_reply = P.recv_reply

    def held(s: socket.socket, op: int) -> P.Frame:
        about_to_read.set()
        go.wait(10)
        return recv_reply(s, op)

    monkeypatch.setattr(P, "recv_reply", held)
    failed: list[BaseException] = []

    def get() -> None:
        try:
            t.batch_get_into([b"k"], [bytearray(16)])
        except BaseException as e:
            failed.append(e)

    reader = threading.Thread(target=get)
    reader.start()
    assert about_to_read.wait(10)
    t.close()
    assert sock.fileno() == fd and os.fstat(fd).st_ino == inode  # still its socket, under the exchange
    go.set()
    reader.join(5)
    assert not reader.is_alive() and len(failed) == 1 and isinstance(failed[0], PoolUnavailable)
    assert sock.fileno() == -1  # freed once the exchange ended
    monkeypatch.undo()

    t.hello()  # connects again; nothing under way: a close frees it at once
    again = t._sock
    assert again is not None
    t.close()
    assert again.fileno() == -1
