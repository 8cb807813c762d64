"""Review of the fixes ddbf798 (pointer adapters check /proc/self/maps) and d7a085c (key identity): cases
the fixes still got wrong (the review's streams tests are in tests/streams/test_adv_streams.py). Each test
names the bug it shows."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from kvpool.core.procs import WorkerProcess

_names = itertools.count()
BLOCK = 64 << 10


def _tenant_store(spawn: Callable[..., WorkerProcess], tenant: str):
    from kvpool.backends.mooncake_compat import MooncakeDistributedStore

    worker = spawn()
    s = MooncakeDistributedStore()
    return s, s.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.unix_path, tenant_id=tenant)


# Bug: the tenant id is percent-quoted with urllib.parse.quote (strict UTF-8): a tenant id holding a lone
# surrogate makes setup() raise UnicodeEncodeError into the engine instead of answering a status.
def test_mooncake_setup_with_a_surrogate_tenant_is_a_status_not_an_exception(spawn):
    try:
        s, rc = _tenant_store(spawn, "team-\udcff")
    except UnicodeError as e:
        pytest.fail(f"setup() raised {e!r}; Mooncake's setup answers a status")
    try:
        assert isinstance(rc, int)
    finally:
        s.close()


# Bug: percent-quoting a tenant id triples each non-ASCII byte ("%E7%A7%9F"): a tenant id of 60 CJK
# characters (180 bytes, keys well under 511 before the fix) now makes a prefix over 511 bytes, and every
# key of that tenant, long-key digest included (it keeps the prefix), is refused: every put fails.
def test_mooncake_tenant_with_a_non_ascii_id_still_stores_its_objects(spawn):
    s, rc = _tenant_store(spawn, "研发" * 30)
    try:
        assert rc == 0
        assert s.put("k", b"of a CJK tenant") == 0
        assert s.get("k") == b"of a CJK tenant"
    finally:
        s.close()
