"""Bad input from the outside: hypothesis writes frames (random bytes, wrong magic and versions,
truncated and huge lengths, batches with odd keys and sizes, bad JSON, unauthenticated and same-node
ops) at a live worker that requires a token. The worker never crashes, never hangs a connection past
its end, gives back every lease and reservation, and its heap stays bounded."""
from __future__ import annotations

import secrets
import socket

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.core import MAX_KEY_BYTES
from kvpool.core import protocol as P
from kvpool.core.auth import NONCE_BYTES, proof
from kvpool.core.client import PoolClient

from faulthelp import heap_bytes

TOKEN = "s3cret"
EXAMPLES = 300
HEAP_GROWTH_LIMIT = 64 << 20

U32 = st.integers(0, (1 << 32) - 1)
U64 = st.integers(0, (1 << 64) - 1)
I64 = st.sampled_from([0, 1, -1, 256, 1 << 20, 1 << 24, 1 << 62, -(1 << 63), (1 << 63) - 1]) | \
    st.integers(-(1 << 63), (1 << 63) - 1)
COMMON = [b"a", b"b", b"c"]  # present in the worker before each example, so lookups hit
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
MUTATIONS = ("magic", "version", "meta_len", "data_len", "crc", "truncate", "meta_junk")


@st.composite
def _key(draw: st.DrawFn) -> bytes:
    """Mostly a present key, sometimes a random one, an empty one or one over the key limit."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return b""
    if kind == 1:
        return draw(st.binary(min_size=MAX_KEY_BYTES + 1, max_size=600))
    if kind < 4:
        return draw(st.binary(min_size=1, max_size=32))
    return draw(st.sampled_from(COMMON))


@st.composite
def _body(draw: st.DrawFn, op: int) -> tuple[bytes, bytes]:
    """Metadata and data that fit `op` (their values may still be absurd)."""
    keys = draw(st.lists(_key(), max_size=5))
    col = lambda: np.array(draw(st.lists(I64, min_size=len(keys), max_size=len(keys))), dtype="<i8")  # noqa: E731
    if op == P.Op.PUT:
        blobs = [draw(st.binary(max_size=2048)) for _ in keys]
        sizes = np.array([len(b) for b in blobs], dtype="<i8") if draw(st.booleans()) else col()
        csums = np.array([xxhash.xxh3_64_intdigest(b) if draw(st.booleans()) else draw(U64) for b in blobs], "<u8")
        return P.pack_batch(keys, sizes, csums, col().astype("<u8")), b"".join(blobs)  # versions: any u64
    if op == P.Op.ALLOC:
        return P.pack_batch(keys, col()), b""
    if op == P.Op.COMMIT:
        return P.pack_batch(keys, col(), col(), col(), col()), b""
    if op in (P.Op.ABORT, P.Op.RELEASE):
        return np.array(draw(st.lists(I64, max_size=5)), dtype="<i8").tobytes(), b""
    if op in (P.Op.HELLO, P.Op.AUTH, P.Op.STATS, P.Op.CLEAR, P.Op.CHANGES):
        return (P.pack_json(draw(JSON)) if draw(st.booleans()) else b""), b""
    # GET, EXISTS, PREFIX, LEASE take keys alone, REMOVE one column; other ops may take 8-byte columns
    fcol = lambda: np.array(draw(st.lists(st.floats(), min_size=len(keys), max_size=len(keys))), "<f8")  # noqa: E731
    return P.pack_batch(keys, *[draw(st.sampled_from([col, fcol]))() for _ in range(draw(st.integers(0, 2)))]), b""


@st.composite
def frame(draw: st.DrawFn) -> bytes:
    """A well-formed frame of a random op with up to two fields broken, or plain random bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(min_size=1, max_size=256))
    op = draw(st.integers(0, 255)) if draw(st.integers(0, 9)) == 0 else draw(st.sampled_from(list(P.Op)))
    meta, data = draw(_body(op))
    broken: set[str] = set()
    if draw(st.integers(0, 2)) == 0:
        broken = draw(st.sets(st.sampled_from(MUTATIONS), min_size=1, max_size=2))
    if "meta_junk" in broken:
        meta = meta[:draw(st.integers(0, len(meta)))] + draw(st.binary(max_size=8))
    meta_len, data_len, crc = len(meta), len(data), xxhash.xxh32_intdigest(meta)
    magic, version = P.MAGIC, P.VERSION
    if "magic" in broken:
        magic = draw(st.binary(min_size=4, max_size=4))
    if "version" in broken:
        version = draw(st.integers(0, 255))
    if "meta_len" in broken:
        meta_len = draw(st.sampled_from([P.MAX_META, P.MAX_META + 1, (1 << 32) - 1]) | U32)
    if "data_len" in broken:
        data_len = draw(st.sampled_from([0, P.MAX_DATA, P.MAX_DATA + 1, 1 << 62, (1 << 64) - 1]) | U64)
    if "crc" in broken:
        crc = draw(U32)
    head = P.HEADER.pack(magic, version, op, 0, draw(U32), meta_len, data_len, crc, 0)
    whole = head + meta + data
    return whole[:draw(st.integers(0, len(whole)))] if "truncate" in broken else whole


def _authenticate(s: socket.socket) -> None:
    """HELLO and AUTH by hand (the challenge-response of kvpool.core.auth), as a client with the token."""
    P.send_frame(s, P.Op.HELLO)
    nonce_w = bytes.fromhex(P.unpack_json(P.recv_reply(s, P.Op.HELLO).meta)["nonce"])
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    P.send_frame(s, P.Op.AUTH, P.pack_json({"nonce": nonce_c.hex(),
                                             "proof": proof(TOKEN, nonce_w, nonce_c, "client").hex()}))
    P.recv_reply(s, P.Op.AUTH)


def _exchange(address: str | tuple[str, int], payload: bytes, authed: bool = False) -> None:
    """Send `payload` (after authenticating, if `authed`), close our side, read until the worker
    closes: it must within the bound."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(address)
        if authed:
            _authenticate(s)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while s.recv(1 << 16):
                pass
        except TimeoutError:
            pytest.fail(f"the worker kept a closed connection open: {payload[:64]!r}")
        except OSError:
            pass  # the worker closed (or reset) first: fine


def test_fuzzed_frames_never_crash_or_leak(spawn):
    w = spawn(extra=["--token", TOKEN])
    with PoolClient(mode="local", worker=w.address, token=TOKEN, timeout_s=5) as good:
        stats = lambda: good.stats().total  # noqa: E731
        heap_before = heap_bytes(w.proc.pid)

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(transport=st.sampled_from(["tcp", "unix"]), authed=st.booleans(),
               frames=st.lists(frame(), min_size=1, max_size=4))
        def exchange(transport: str, authed: bool, frames: list[bytes]) -> None:
            good.clear()
            held = stats().dram_bytes  # 0, unless an earlier example leaked (and failed)
            good.batch_put(COMMON, [b"x" * 1000] * len(COMMON))
            address = ("127.0.0.1", w.port) if transport == "tcp" else w.unix_path
            _exchange(address, b"".join(frames), authed and transport == "tcp")
            assert w.proc.poll() is None, f"the worker died: {w.log_tail()}"
            # the worker closed the connection after giving back its leases and reservations
            good.clear()
            assert stats().dram_bytes == held, "a lease or reservation outlived its connection"

        exchange()
        growth = heap_bytes(w.proc.pid) - heap_before
        assert growth < HEAP_GROWTH_LIMIT, f"worker heap grew by {growth} bytes"
        good.put("sentinel", b"again")
        assert good.get("sentinel") == b"again"
    assert "Traceback" not in w.log_path.read_text(), w.log_tail()


def test_claimed_lengths_cost_no_memory_until_the_bytes_arrive(spawn):
    """Headers that claim the largest metadata, from unauthenticated peers that then send nothing:
    the worker must not reserve what they claim (16 connections x 16 MiB here)."""
    w = spawn(extra=["--token", TOKEN])
    heap_before = heap_bytes(w.proc.pid)
    head = P.HEADER.pack(P.MAGIC, P.VERSION, P.Op.HELLO, 0, 1, P.MAX_META, 0, 0, 0)
    socks = [socket.create_connection(("127.0.0.1", w.port), timeout=5) for _ in range(16)]
    try:
        for s in socks:
            s.sendall(head + b"{" * 1000)
        with PoolClient(mode="local", worker=w.address, token=TOKEN, timeout_s=5) as good:
            good.put("k", b"v")  # the worker has read what the peers sent by now
            assert good.get("k") == b"v"
        growth = heap_bytes(w.proc.pid) - heap_before
        assert growth < HEAP_GROWTH_LIMIT, f"worker heap grew by {growth >> 20} MiB for bytes never sent"
    finally:
        for s in socks:
            s.close()
