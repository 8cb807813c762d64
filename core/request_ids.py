"""Request ids on a client's connection: each request the next id, each reply checked against the oldest
request still owed one.

The worker echoes a request's id in its reply (`protocol.Frame.req_id`) and answers a connection's
requests in order. A reply that does not carry the id of the oldest request owed one is not that
request's: a reply left unread on the connection, or one a bug on either side sent twice. Without the
check it would be taken for the next reply of its operation (another key's bytes); with it, the
exchange fails (ProtocolError, which drops the connection) and nothing is read into the caller's
buffers. Requests with no reply (`protocol.ONE_WAY`) take an id too, but nothing waits for one.

Ids are kept per socket (a new connection starts again), by the socket itself: weakly, so a closed
socket's go with it. A socket carries one exchange at a time (`Connection._session`), so its ids need
no lock of their own.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Any

from .errors import ProtocolError

__all__ = ["issue", "check", "owed"]

_MAX = 0xFFFFFFFF
"""Ids are u32 on the wire; 0 is never used (a peer that does not number its requests sends 0)."""


class _Ids:
    __slots__ = ("last", "owed")

    def __init__(self) -> None:
        self.last = 0
        self.owed: deque[int] = deque()


_BY_SOCKET: weakref.WeakKeyDictionary[Any, _Ids] = weakref.WeakKeyDictionary()


def issue(sock: Any, answered: bool) -> int:
    """The id of the next request sent on `sock`; with `answered`, its reply is owed next after those
    owed already."""
    ids = _BY_SOCKET.get(sock)
    if ids is None:
        ids = _BY_SOCKET[sock] = _Ids()
    ids.last = ids.last % _MAX + 1
    if answered:
        ids.owed.append(ids.last)
    return ids.last


def check(sock: Any, req_id: int) -> None:
    """The reply just read on `sock` carries `req_id`: ProtocolError unless it is the oldest one owed."""
    ids = _BY_SOCKET.get(sock)
    want = ids.owed.popleft() if ids is not None and ids.owed else None
    if req_id != want:
        raise ProtocolError(f"reply to request {req_id} where the reply to request {want} was due "
                            "(a stray reply on the connection): dropped, and the connection with it")


def owed(sock: Any) -> int:
    """How many replies `sock` still owes (0: every exchange on it is whole)."""
    ids = _BY_SOCKET.get(sock)
    return 0 if ids is None else len(ids.owed)
