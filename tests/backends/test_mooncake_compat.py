"""The Mooncake-API drop-in, driven as FastDeploy's `mooncake_store.py` drives Mooncake Store, and the
`mooncake` shim that makes `from mooncake.store import MooncakeDistributedStore` resolve to kvpool."""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.backends.mooncake_compat import MooncakeDistributedStore, ReplicateConfig, Status, pool_options
from kvpool.backends.mooncake_shim import add_parser, shim_path
from kvpool.core.client import PoolClient
from kvpool.core.nats_server import NatsServer

from bkhelp import HostBuffer, MiB, payload

STRIDE = 3 * 2 * 16 * 32 * 2  # one block: layers x heads x tokens x head_dim x bf16


class FastDeployMooncakeStore:
    """The calls FastDeploy's MooncakeStore (transfer_factory/mooncake_store/mooncake_store.py) makes,
    in its order and with its checks, on whatever `MooncakeDistributedStore` it is given."""

    def __init__(self, store: MooncakeDistributedStore, master: str, metadata: str = "P2PHANDSHAKE",
                 segment: int = 32 * MiB) -> None:
        self.store = store
        rc = store.setup(local_hostname="localhost", metadata_server=metadata, global_segment_size=segment,
                         local_buffer_size=128 * MiB, protocol="rdma", rdma_devices="", master_server_addr=master)
        if rc != 0:
            raise RuntimeError(f"failed to setup mooncake store, error code: {rc}")
        warmup_key = "fastdeploy_mooncake_store_warmup_key" + str(uuid.uuid4())
        self.store.put(warmup_key, bytes(1 * MiB))
        assert self.store.is_exist(warmup_key) == 1
        self.store.get(warmup_key)
        self.warmup_removed = self.store.remove(warmup_key)

    def register_buffer(self, ptr: int, size: int) -> None:
        assert self.store.register_buffer(ptr, size) == 0

    def batch_set(self, keys: list[str], target_locations: list[int], target_sizes: list[int]) -> list[int]:
        return self.store.batch_put_from(keys, target_locations, target_sizes)

    def batch_get(self, keys: list[str], target_locations: list[int], target_sizes: list[int]) -> list[int]:
        return self.store.batch_get_into(keys, target_locations, target_sizes)

    def exists(self, keys: list[str]) -> dict[str, int]:
        return dict(zip(keys, self.store.batch_is_exist(keys)))

    def query(self, k_keys: list[str], v_keys: list[str]) -> int:
        result = self.exists(k_keys + v_keys)
        num = 0
        for k, v in zip(k_keys, v_keys):
            if not (result[k] and result[v]):
                break
            num += 1
        return num

    def delete(self, key: str, timeout: int = 5) -> bool:
        while timeout:
            if self.store.remove(key) == 0:
                return True
            time.sleep(0.05)
            timeout -= 1
        return False

    def clear(self) -> int:
        return self.store.remove_all()


def kv_round_trip(fd: FastDeployMooncakeStore, blocks: int = 4, tag: str = "h") -> None:
    """Write `blocks` K/V blocks from a write buffer, read them into a read buffer, compare every byte."""
    write, read = HostBuffer(2 * blocks * STRIDE), HostBuffer(2 * blocks * STRIDE, "torch")
    fd.register_buffer(write.ptr, write.nbytes)
    fd.register_buffer(read.ptr, read.nbytes)
    write.array[:] = payload(tag, write.nbytes)
    k = [f"prefix_{tag}{i}_0_key" for i in range(blocks)]
    v = [f"prefix_{tag}{i}_0_value" for i in range(blocks)]
    locs = [b.ptr + i * STRIDE for b in (write,) for i in range(2 * blocks)]
    assert fd.query(k, v) == 0
    assert fd.batch_set(k + v, locs, [STRIDE] * 2 * blocks) == [0] * 2 * blocks
    assert fd.query(k, v) == blocks
    got = fd.batch_get(k + v, [read.ptr + i * STRIDE for i in range(2 * blocks)], [STRIDE] * 2 * blocks)
    assert got == [STRIDE] * 2 * blocks
    assert np.array_equal(read.array, write.array)


def test_fastdeploy_flow_on_the_embedded_pool(store: MooncakeDistributedStore, small_env: None) -> None:
    fd = FastDeployMooncakeStore(store, master="embedded")
    assert fd.warmup_removed == 0  # no leases to wait out, unlike Mooncake: the warmup key does not leak
    assert store._io._client is not None and store._io._client.stats().total.dram_capacity == 32 * MiB
    kv_round_trip(fd)
    k0, v0 = "prefix_h0_0_key", "prefix_h0_0_value"
    assert store.get_size(k0) == STRIDE and store.get_size("nope") == Status.OBJECT_NOT_FOUND
    assert fd.delete(v0) and not fd.delete(v0, timeout=2)
    assert store.remove(v0) == Status.OBJECT_NOT_FOUND
    assert fd.query([k0, "prefix_h1_0_key"], [v0, "prefix_h1_0_value"]) == 0
    assert fd.exists([k0, v0]) == {k0: 1, v0: 0}
    assert fd.clear() == 7
    assert store.batch_is_exist([k0, "prefix_h1_0_key"]) == [0, 0]


def test_statuses_match_mooncake(store: MooncakeDistributedStore, small_env: None) -> None:
    assert store.setup("localhost", "P2PHANDSHAKE", 32 * MiB, 16 * MiB, "tcp", "", "embedded") == 0
    buf, stray = HostBuffer(4 * STRIDE), HostBuffer(STRIDE)
    assert store.register_buffer(buf.ptr, buf.nbytes) == 0
    assert store.register_buffer(0, 10) == Status.INVALID_PARAMS
    buf.array[:] = payload("codes", buf.nbytes)
    assert store.batch_put_from(["a", "b", "c", "z"], [buf.ptr, buf.ptr + STRIDE, stray.ptr, buf.ptr],
                                [STRIDE, STRIDE, STRIDE, 0]) == [0, 0, -600, -600]
    got = store.batch_get_into(["a", "b", "missing"], [buf.ptr + 2 * STRIDE, buf.ptr + 3 * STRIDE, buf.ptr],
                               [STRIDE * 2, STRIDE - 1, STRIDE])
    # another size than the room (larger or smaller): INVALID_PARAMS (Mooncake answers a larger room with
    # the object's size, which engines take as a whole page loaded); a miss: OBJECT_NOT_FOUND
    assert got == [-600, -600, -704]
    buf.array[2 * STRIDE:] = 0
    assert store.batch_get_into(["a"], [buf.ptr + 2 * STRIDE], [STRIDE]) == [STRIDE]
    assert np.array_equal(buf.at(2 * STRIDE, STRIDE), buf.at(0, STRIDE))
    assert store.batch_put_from(["x"], [buf.ptr, buf.ptr], [1]) == [Status.INVALID_PARAMS]
    assert store.batch_get_into([], [], []) == []
    assert store.put_from("pf", buf.ptr, 100) == 0 and store.get_into("pf", stray.ptr, STRIDE) == -600
    assert store.get_into("pf", buf.ptr + STRIDE, 100) == 100
    assert store.put("e", b"") == -600 and store.get("missing") == b""
    assert store.put("p", b"hello", ReplicateConfig(replica_num=2)) == 0 and store.get("p") == b"hello"
    assert store.put_parts("pp", b"ab", bytearray(b"cd"), np.frombuffer(b"ef", np.uint8)) == 0
    assert store.get("pp") == b"abcdef" and store.get_size("pp") == 6
    assert store.put_batch(["q1", "q2"], [b"1", b"22"]) == 0
    assert store.get_batch(["q1", "q2", "q3"]) == [b"1", b"22", b""]
    assert store.batch_remove(["q1", "q3"]) == [0, -704]
    assert store.is_exist("p") == 1 and store.is_exist("q1") == 0
    assert store.batch_is_exist(["p", "x" * 600, "", "q2"]) == [1, 0, 0, 1]  # a bad key is absent, alone
    assert store.unregister_buffer(buf.ptr) == 0 and store.unregister_buffer(buf.ptr) == Status.INVALID_PARAMS
    assert store.batch_put_from(["a"], [buf.ptr], [STRIDE]) == [-600]  # no longer registered
    assert store.health_check() == 0 and store.get_hostname() == "localhost"
    assert store.close() == 0 and store.health_check() == 1
    assert store.batch_is_exist(["p"]) == [0] and store.put("p", b"x") == Status.RPC_FAIL


def test_calls_before_setup_fail_softly(store: MooncakeDistributedStore) -> None:
    buf = HostBuffer(64)
    assert store.register_buffer(buf.ptr, 64) == 0  # kept for after setup
    assert store.batch_is_exist(["a"]) == [0] and store.get("a") == b""
    assert store.batch_put_from(["a"], [buf.ptr], [64]) == [Status.RPC_FAIL]
    assert store.batch_get_into(["a"], [buf.ptr], [64]) == [Status.RPC_FAIL]
    assert store.remove_all() == Status.RPC_FAIL and store.health_check() == 1


def test_setup_accepts_the_config_dict_form(store: MooncakeDistributedStore, small_env: None) -> None:
    assert store.setup({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE", "master_server_addr": "embedded",
                        "global_segment_size": 16 * MiB, "protocol": "tcp"}) == 0
    assert store.put("k", b"v") == 0 and store.get("k") == b"v" and store.get_hostname() == "h"


def test_bad_configuration_is_a_failed_setup(store: MooncakeDistributedStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_MODE", "sideways")
    assert store.setup("localhost", "", 0, 0, "tcp", "", "") == Status.INVALID_PARAMS
    assert store.health_check() == 1


def test_setup_addresses_map_to_pool_modes() -> None:
    env: dict[str, str] = {}
    assert pool_options("nats://10.0.0.1:4222", "P2PHANDSHAKE", 0, env) == {"mode": "cluster", "nats_url": "nats://10.0.0.1:4222"}
    assert pool_options("", "tls://nats.example:4222", 0, env) == {"mode": "cluster", "nats_url": "tls://nats.example:4222"}
    sock = "/run/kvpool/worker-7461.sock"
    assert pool_options(sock, "", 0, env) == {"mode": "local", "worker": sock}
    assert pool_options("10.0.0.2:7461", "http://10.0.0.1:8080/metadata", 0, env) == {"mode": "local",
                                                                                      "worker": "10.0.0.2:7461"}
    assert pool_options("kvpool", "http://10.0.0.1:8080", 0, env) == {}  # a Mooncake metadata URL names no pool
    assert pool_options("embedded", "", 1 << 30, env) == {"mode": "embedded", "dram_bytes": 1 << 30}
    assert pool_options("", "P2PHANDSHAKE", 1 << 30, env) == {"dram_bytes": 1 << 30}
    assert pool_options("", "", 1 << 30, {"KVPOOL_DRAM_BYTES": "4GiB"}) == {}
    assert pool_options("", "", 1 << 30, {"KVPOOL_MODE": "cluster"}) == {}
    assert pool_options("embedded", "", 1 << 20, env) == {"mode": "embedded"}  # below one slab: default size


def test_local_worker_then_worker_killed(store: MooncakeDistributedStore, spawn: Callable[..., Any]) -> None:
    worker = spawn()
    fd = FastDeployMooncakeStore(store, master=worker.unix_path)
    kv_round_trip(fd)
    assert store.health_check() == 0
    tcp = MooncakeDistributedStore()
    try:  # a second client over TCP sees the same pool
        assert tcp.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.address) == 0
        assert tcp.batch_is_exist(["prefix_h0_0_key", "prefix_h3_0_value", "nope"]) == [1, 1, 0]
        assert tcp.get_size("prefix_h2_0_key") == STRIDE
        worker.kill()
        assert tcp.batch_is_exist(["prefix_h0_0_key"]) == [0]
        assert tcp.get("prefix_h0_0_key") == b"" and tcp.health_check() == 2
    finally:
        tcp.close()


def test_unreachable_worker_is_misses_not_exceptions(store: MooncakeDistributedStore, tmp_path: Path) -> None:
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", str(tmp_path / "none.sock")) == 0
    buf = HostBuffer(STRIDE)
    assert store.register_buffer(buf.ptr, STRIDE) == 0
    assert store.batch_put_from(["a"], [buf.ptr], [STRIDE]) == [Status.RPC_FAIL]
    assert store.batch_get_into(["a"], [buf.ptr], [STRIDE]) == [Status.RPC_FAIL]
    assert store.batch_is_exist(["a", "b"]) == [0, 0] and store.is_exist("a") == 0
    assert store.remove("a") == Status.RPC_FAIL and store.get_size("a") == Status.RPC_FAIL
    assert store.health_check() == 2


def test_cluster_through_nats(store: MooncakeDistributedStore, spawn: Callable[..., Any], tmp_path: Path) -> None:
    nats = NatsServer(tmp_path / "nats", port=0).start()
    try:
        spawn(nats_url=nats.url)
        assert _wait_healthy(store, nats.url)  # the worker has registered and the client has seen it
        fd = FastDeployMooncakeStore(store, master=nats.url, metadata="http://127.0.0.1:8080/metadata")
        kv_round_trip(fd, tag="c")
    finally:
        store.close()
        nats.stop()


def _wait_healthy(store: MooncakeDistributedStore, nats_url: str, timeout: float = 15.0) -> bool:
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", nats_url) == 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.health_check() == 0:
            return True
        time.sleep(0.1)
    return False


def test_shim_makes_mooncake_store_resolve_to_kvpool(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import importlib.util, json
        from mooncake.store import MooncakeDistributedStore
        import kvpool.backends.mooncake_compat as compat
        engine = importlib.util.find_spec("mooncake.engine")
        print(json.dumps({"same": MooncakeDistributedStore is compat.MooncakeDistributedStore,
                          "engine": engine.origin if engine else None}))
    """)
    env = {**os.environ, "PYTHONPATH": shim_path()}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["same"] is True
    real = importlib.util.find_spec("mooncake")
    if real is not None and real.origin and shim_path() not in real.origin:  # a real Mooncake is installed too
        assert result["engine"] and not result["engine"].startswith(shim_path())


def test_shim_command_prints_the_path(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvpool")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["mooncake-shim"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == shim_path() and (Path(printed) / "mooncake" / "store.py").is_file()


def test_multi_buffer_calls_gather_and_scatter(store: MooncakeDistributedStore, small_env: None) -> None:
    assert store.setup("h", "P2PHANDSHAKE", 16 * MiB, 0, "tcp", "", "embedded") == 0
    part, layers = 512, 4
    src, dst = HostBuffer(2 * layers * part), HostBuffer(2 * layers * part)
    for b in (src, dst):
        assert store.register_buffer(b.ptr, b.nbytes) == 0
    src.array[:] = payload("m", src.nbytes)
    # layer-first: key i's part for layer l sits at (l * 2 + i) * part, as in SGLang's MLA host pool
    ptrs = lambda b: [[b.ptr + (layer * 2 + i) * part for layer in range(layers)] for i in range(2)]  # noqa: E731
    sizes = [[part] * layers] * 2
    assert store.batch_put_from_multi_buffers(["k0", "k1"], ptrs(src), sizes, ReplicateConfig()) == [0, 0]
    assert store.get("k1") == b"".join(bytes(src.array[(layer * 2 + 1) * part:(layer * 2 + 2) * part])
                                       for layer in range(layers))
    assert store.batch_get_into_multi_buffers(["k0", "k1"], ptrs(dst), sizes) == [layers * part] * 2
    assert np.array_equal(dst.array, src.array)
    # a miss, parts that do not add up to the object, and malformed lists: statuses, nothing half-written
    dst.array[:] = 0
    assert store.batch_get_into_multi_buffers(["nope"], [[dst.ptr]], [[part]]) == [Status.OBJECT_NOT_FOUND]
    assert store.batch_get_into_multi_buffers(["k0"], [ptrs(dst)[0][:3]], [[part] * 3]) == [Status.INVALID_PARAMS]
    assert store.batch_get_into_multi_buffers(["k0"], [[dst.ptr, dst.ptr + part]], [[part]]) == [Status.INVALID_PARAMS]
    assert store.batch_get_into_multi_buffers(["k0", "k1"], ptrs(dst)[:1], sizes[:1]) == [Status.INVALID_PARAMS] * 2
    assert store.batch_put_from_multi_buffers(["k2"], [[12345]], [[part]]) == [Status.INVALID_PARAMS]
    assert not dst.array.any()


def test_setup_forms_of_newer_callers(store: MooncakeDistributedStore, small_env: None) -> None:
    # SGLang 0.5.23: seven positionals, a shared transfer engine eighth, then keywords
    assert store.setup("h", "P2PHANDSHAKE", 16 * MiB, 0, "tcp", "", "embedded", None,
                       enable_ssd_offload=True, ssd_offload_path="/tmp/ignored") == 0
    assert store.put("k", b"v") == 0 and store.get("k") == b"v"
    other = MooncakeDistributedStore()
    try:
        assert other.setup(local_hostname="h", metadata_server="P2PHANDSHAKE", global_segment_size=16 * MiB,
                           local_buffer_size=0, protocol="tcp", rdma_devices="", master_server_addr="embedded",
                           engine=object(), tenant_id="default") == 0
        assert other.setup({"master_server_address": "embedded", "global_segment_size": 16 * MiB,
                            "device_name": "", "tenant_id": "t1", "unknown_option": 1}) == 0
        assert other.put("k", b"t1") == 0 and other.get("k") == b"t1"
        assert other.setup_dummy(16 * MiB, 0, "embedded") == 0
    finally:
        other.close()


def test_tenants_are_namespaces(store: MooncakeDistributedStore, spawn: Callable[..., Any]) -> None:
    worker = spawn()
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        assert store.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.unix_path) == 0
        assert a.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.unix_path, tenant_id="a") == 0
        assert b.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.address, tenant_id="b") == 0
        assert a.put("k", b"of a") == 0 and store.put("k", b"of nobody") == 0
        assert a.get("k") == b"of a" and store.get("k") == b"of nobody"
        assert b.get("k") == b"" and b.is_exist("k") == 0 and b.remove("k") == Status.OBJECT_NOT_FOUND
        buf = HostBuffer(64)
        assert b.register_buffer(buf.ptr, 64) == 0
        assert b.batch_get_into(["k"], [buf.ptr], [64]) == [Status.OBJECT_NOT_FOUND]
        assert b.put("k", b"of b") == 0 and b.remove_all() >= 0  # only tenant b's objects
        assert b.get("k") == b"" and a.get("k") == b"of a" and store.get("k") == b"of nobody"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("variable", ["KVPOOL_NATS_URL", "KVPOOL_WORKER"])
def test_kvpool_variables_alone_choose_the_mode(store: MooncakeDistributedStore, spawn: Callable[..., Any],
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 variable: str) -> None:
    nats = NatsServer(tmp_path / "nats", port=0).start() if variable == "KVPOOL_NATS_URL" else None
    try:
        worker = spawn(nats_url=nats.url if nats else None)
        monkeypatch.setenv(variable, nats.url if nats else worker.unix_path)
        # as SGLang calls it with MOONCAKE_MASTER unset: the segment size must not force embedded mode
        assert store.setup("localhost", "P2PHANDSHAKE", 4 << 30, 0, "tcp", "", "") == 0
        deadline = time.monotonic() + 15
        while store.health_check() != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.put("k", b"v") == 0
        with PoolClient(worker=worker.unix_path) as direct:  # the block is in the worker, not in-process
            assert direct.get("k") == b"v"
    finally:
        store.close()
        if nats:
            nats.stop()


@pytest.mark.parametrize("where", ["embedded", "cluster"])
def test_a_caller_that_never_closes_leaves_nothing_and_exits(spawn: Callable[..., Any], tmp_path: Path,
                                                              where: str) -> None:
    """Engines drop the store without close(): the process must still exit at once, with no arena left."""
    nats = NatsServer(tmp_path / "nats", port=0).start() if where == "cluster" else None
    try:
        if nats:
            spawn(nats_url=nats.url)
        master = nats.url if nats else "embedded"
        code = textwrap.dedent(f"""
            from kvpool.backends.mooncake_compat import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            import time
            assert s.setup("h", "P2PHANDSHAKE", 32 << 20, 0, "tcp", "", {master!r}) == 0
            deadline = time.monotonic() + 15
            while s.health_check() != 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            print(s.put("k", b"v"), flush=True)
        """)
        env = {**os.environ, "KVPOOL_DRAM_SLAB_SIZE": "1MiB", "KVPOOL_PREFAULT": "false"}
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert out.strip() == "0"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvpool-{proc.pid}-")]
    finally:
        if nats:
            nats.stop()


def test_odd_keys_and_values_are_statuses_not_exceptions(store: MooncakeDistributedStore, small_env: None) -> None:
    assert store.setup({"master_server_address": "embedded", "global_segment_size": 16 * MiB, "device_name": "",
                        "tenant_id": "t1"}) == 0  # a tenant: keys go under its namespace
    bad = int(Status.INVALID_PARAMS)
    assert store.put(None, b"v") != 0 and store.put(b"raw", b"v") != 0  # type: ignore[arg-type]
    assert store.put("k", None) == bad and store.put("k", "text") == bad and store.put_parts("k", 7) == bad
    assert store.batch_is_exist([None, 5, b"raw", "k"]) == [0, 0, 0, 0]  # type: ignore[list-item]
    assert store.get(None) == b""  # type: ignore[arg-type]


def test_an_outage_is_logged_once_however_the_engine_keeps_asking(store: MooncakeDistributedStore,
                                                                  spawn: Callable[..., Any], tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Existence checks answer "absent" while the cluster's only worker is down (a miss, not an error):
    they must not end the outage in the log, so the next failed put does not open a new one."""
    nats = NatsServer(tmp_path / "nats", port=0).start()
    try:
        worker = spawn(nats_url=nats.url)
        assert _wait_healthy(store, nats.url)
        buf = HostBuffer(1 << 16)
        store.register_buffer(buf.ptr, buf.nbytes)
        assert store.batch_put_from(["k"], [buf.ptr], [4096]) == [0]
        worker.kill()
        with caplog.at_level(logging.DEBUG):
            deadline = time.monotonic() + 4  # several of the client's retries (1 s) and suspect periods (2 s)
            while time.monotonic() < deadline:
                assert store.batch_is_exist(["k"]) == [0]
                assert store.batch_put_from(["k"], [buf.ptr], [4096])[0] < 0
                time.sleep(0.05)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert sum("kvpool unavailable" in r.getMessage() for r in warnings) == 1
        assert sum("failed" in r.getMessage() and r.name == "kvpool.client" for r in warnings) <= 1
        assert not any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        store.close()
        nats.stop()
