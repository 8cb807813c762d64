"""Backends: SGLang HiCache v1 and v2 and FastDeploy batches through kvpool vs memcpy and SGLang's file backend.

One batch is SGLang's backup/prefetch unit here: 64 pages of an MHA model with 32 layers and 64-token
pages in bf16, in a real SGLang host pool (page_first layout), each page one K and one V block of all
layers. `KVPoolHiCacheStorage.batch_set_v1` / `batch_get_v1` move it between the host pool and an
embedded pool, and a local worker (shared memory); `batch_set_v2` / `batch_get_v2` move the same pages
as a hybrid model's side pool (registered as SGLang's SWA pool, an MHA host pool of the same shape,
through `register_mem_host_pool_v2`); the peer is SGLang's built-in `file` backend on
the same pages, driven as SGLang's controller drives a backend without v1 (its files stay in the page
cache). FastDeploy's `KVPoolStore.batch_set` / `batch_get` move the same bytes between registered
staging buffers and the pool. The baseline of each is numpy copies of the same blocks between the
same buffers, timed in turn with the operations it is compared with (this box is shared: turns keep
a burst of load from favouring one side).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.core import BenchError
from kvpool.core.bench import WorkerProcess, best_in_turns, emit, filled, gbps

_PAGES, _LAYERS, _PAGE_TOKENS, _HEAD_DIM = 64, 32, 64, 128
_INSTALL_HINT = ("SGLang is not installed: from a kvpool checkout, `pip install --no-deps -r requirements/sglang.txt` "
                 "(SGLang 0.5.23 without its GPU stack)")
_SGLANG_CPU = Path(__file__).resolve().parents[1] / "tests" / "backends" / "sglang_cpu.py"
"""SGLang's CPU stand-ins and host-pool builder: test scaffolding in a kvpool checkout, never installed
with the package; loaded from there at run time."""

Op = tuple[Callable[[], Any] | None, Callable[[], Any]]
"""(untimed preparation or None, the timed call)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-heads", type=int, default=None,
                   help="KV heads per rank (default 8, as Llama-3-8B at TP 1; 2 with --quick, as at TP 4)")
    p.add_argument("--sglang-cpu", default=str(_SGLANG_CPU),
                   help="SGLang's CPU stand-ins (tests/backends/sglang_cpu.py of a kvpool checkout)")


class _NoStandIns(ImportError):
    """No tests/backends/sglang_cpu.py where it was looked for (an installed kvpool, outside a checkout)."""


def _load_sglang_cpu(path: str) -> types.ModuleType:
    """The stand-ins module at `path`, as `sglang_cpu` (the tests' name: one copy in a process)."""
    file = Path(path).resolve()
    loaded = sys.modules.get("sglang_cpu")
    if loaded is not None and Path(loaded.__file__ or "").resolve() == file:
        return loaded
    spec = importlib.util.spec_from_file_location("sglang_cpu", file)
    if not file.is_file() or spec is None or spec.loader is None:
        raise _NoStandIns(f"SGLang's host pools are built by tests/backends/sglang_cpu.py of a kvpool "
                          f"checkout, not found at {file}: run from a checkout or pass --sglang-cpu PATH")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_cpu"] = module  # as an import does: registered while its body runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["sglang_cpu"]
        raise
    return module


def _in_turns(ops: dict[str, Op], nbytes: int, repeat: int) -> dict[str, float]:
    """GB/s of the fastest of `repeat` timed calls of each op, the ops taking turns after one untimed
    warm-up turn (`measure.best_in_turns`)."""
    def turn(prepare: Callable[[], Any] | None, call: Callable[[], Any]) -> float:
        if prepare is not None:
            prepare()
        t = time.perf_counter()
        call()
        return time.perf_counter() - t

    best = best_in_turns({name: functools.partial(turn, *op) for name, op in ops.items()}, repeat)
    return {name: gbps(nbytes, s) for name, s in best.items()}


def _copier(src: list[np.ndarray], dst: list[np.ndarray]) -> Callable[[], None]:
    def copy() -> None:
        for a, b in zip(src, dst):
            np.copyto(b, a)
    return copy


class _Geometry:
    """Sizes of one batch, as reported in the output."""

    def __init__(self, kv_heads: int) -> None:
        self.kv_heads = kv_heads
        self.block = _LAYERS * _PAGE_TOKENS * kv_heads * _HEAD_DIM * 2  # K (or V) of one page, all layers, bf16
        self.batch = 2 * _PAGES * self.block

    def describe(self) -> dict[str, Any]:
        return {"pages_per_batch": _PAGES, "layers": _LAYERS, "page_tokens": _PAGE_TOKENS, "kv_heads": self.kv_heads,
                "head_dim": _HEAD_DIM, "dtype": "bf16", "layout": "page_first", "block_bytes": self.block,
                "batch_bytes": self.batch}

    def pool_bytes(self) -> int:
        return 2 * self.batch + (64 << 20)


def _sglang(geo: _Geometry, repeat: int, worker: WorkerProcess, stand_ins: str) -> dict[str, float]:
    """GB/s of batch_set_v1 / batch_get_v1 (embedded, local worker), of the file backend, and of
    memcpy between the same host-pool pages in each turn."""
    import torch

    sglang_cpu = _load_sglang_cpu(stand_ins)
    sglang_cpu.install()
    with sglang_cpu.quiet_import():
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    host = sglang_cpu.host_pool("page_first", pages=2 * _PAGES, page=_PAGE_TOKENS, layers=_LAYERS,
                                heads=geo.kv_heads, head_dim=_HEAD_DIM)
    src, dst = host.alloc(_PAGES * _PAGE_TOKENS), host.alloc(_PAGES * _PAGE_TOKENS)
    keys = [f"{i:064x}" for i in range(1, _PAGES + 1)]
    raw = host.kv_buffer.view(torch.uint8)  # page_first: (K|V, token slot, layer, head, dim bytes)
    starts = [(int(src[i * _PAGE_TOKENS]), int(dst[i * _PAGE_TOKENS])) for i in range(_PAGES)]
    arr = raw.numpy()
    memcpy = _copier([arr[kv, s:s + _PAGE_TOKENS] for s, _ in starts for kv in (0, 1)],
                     [arr[kv, d:d + _PAGE_TOKENS] for _, d in starts for kv in (0, 1)])

    def config(extra: dict[str, Any]) -> Any:
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                    is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                    model_name="bench/llama-3-8b", extra_config=extra)

    def timed(backend: Any, put: Callable[[], Any], get: Callable[[], Any]) -> dict[str, float]:
        """put and get in turns with memcpy (a stored page is not written again: each timed put starts
        from an empty store), then one more get into zeroed pages, which must equal the pages put."""
        r = _in_turns({"memcpy": (None, memcpy), "put": (backend.clear, put), "get": (None, get)}, geo.batch, repeat)
        raw[:, dst] = 0
        get()
        if not torch.equal(raw[:, src], raw[:, dst]):
            raise BenchError(f"{type(backend).__name__}: pages read back differ from pages written")
        return r

    out: dict[str, float] = {}
    dynamic = {"backend_name": "kvpool", "module_path": "kvpool.backends.sglang", "class_name": "KVPoolHiCacheStorage",
               "interface_v1": 1}
    for tag, extra in (("", {**dynamic, "dram_bytes": geo.pool_bytes()}),
                       ("_local", {**dynamic, "mode": "local", "worker": worker.unix_path})):
        kv = StorageBackendFactory.create_backend("dynamic", config(extra), host)
        kv.register_mem_pool_host(host)
        kv.register_mem_host_pool_v2(host, PoolName.SWA)
        try:
            r = timed(kv, functools.partial(kv.batch_set_v1, keys, src), functools.partial(kv.batch_get_v1, keys, dst))
            v2 = timed(kv, functools.partial(kv.batch_set_v2, [PoolTransfer(PoolName.SWA, src, keys=keys)]),
                       functools.partial(kv.batch_get_v2, [PoolTransfer(PoolName.SWA, dst, keys=keys)]))
        finally:
            kv.close()
        out.update({f"{k}{tag}": v for k, v in r.items()})
        out.update({f"v2_{k}{tag}": v for k, v in v2.items()})
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-hicache-") as d:
        fb = StorageBackendFactory.create_backend("file", config({"file_storage_path": d}), host)
        fb.register_mem_pool_host(host)

        def file_get() -> None:  # SGLang's generic page get: read flat pages, copy them into the host pool
            pages = fb.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
            for (_, slot), page in zip(starts, pages):
                host.set_from_flat_data_page(slot, page)
        def file_put() -> None:  # SGLang's generic page set: flat pages of the host pool
            fb.batch_set(keys, [host.get_data_page(slot, flat=True) for slot, _ in starts])
        r = timed(fb, file_put, file_get)
    out.update({f"file_{k}": v for k, v in r.items()})
    return out


def _fastdeploy(geo: _Geometry, repeat: int, worker: WorkerProcess) -> dict[str, float]:
    """GB/s of KVPoolStore.batch_set / batch_get of 64 K and 64 V blocks (embedded, local worker), and
    of memcpy between the same staging buffers in each turn."""
    from kvpool.backends.fastdeploy import KVPoolStore

    src = filled(geo.batch, 9)
    dst = np.zeros_like(src)
    n = 2 * _PAGES
    keys = [f"prefix_{i:064x}_0_{kind}" for kind in ("key", "value") for i in range(_PAGES)]
    sizes = [geo.block] * n
    put_locs = [src.ctypes.data + i * geo.block for i in range(n)]
    get_locs = [dst.ctypes.data + i * geo.block for i in range(n)]
    memcpy = _copier(list(src.reshape(n, geo.block)), list(dst.reshape(n, geo.block)))
    out: dict[str, float] = {}
    for tag, opts in (("", {"dram_bytes": geo.pool_bytes()}),
                      ("_local", {"mode": "local", "worker": worker.unix_path})):
        store = KVPoolStore("bench", **opts)
        try:
            for buf in (src, dst):
                store.register_buffer(buf.ctypes.data, buf.nbytes)
            put = functools.partial(store.batch_set, keys, put_locs, sizes)
            get = functools.partial(store.batch_get, keys, get_locs, sizes)
            r = _in_turns({"memcpy": (None, memcpy), "put": (None, put), "get": (functools.partial(dst.fill, 0), get)},
                          geo.batch, repeat)
            if not np.array_equal(src, dst):
                raise BenchError("FastDeploy path: blocks read back differ from blocks written")
        finally:
            store.close()
        out.update({f"{k}{tag}": v for k, v in r.items()})
    return out


def run(args: argparse.Namespace) -> int:
    repeat = 5 if args.quick else 10
    geo = _Geometry(args.kv_heads or (2 if args.quick else 8))
    metrics: dict[str, Any] = geo.describe()
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as state:
        worker = WorkerProcess(state, dram_bytes=str(geo.pool_bytes()))
        try:
            worker.wait_ready()
            try:
                sg: dict[str, float] | None = _sglang(geo, repeat, worker, args.sglang_cpu)
            except _NoStandIns as e:
                sg = None
                metrics["sglang"] = f"skipped: {e}"
            except ImportError as e:
                sg = None
                metrics["sglang"] = f"skipped: {_INSTALL_HINT} ({e})"
            fd = _fastdeploy(geo, repeat, worker)
        finally:
            worker.stop()
    for path, got in (("sglang", sg), ("fastdeploy", fd)):
        if got is None:
            continue
        metrics.update({f"{path}_{k}_gbps": round(v, 2) for k, v in got.items()})
        for tag in ("", "_local"):
            ratios[f"{path}_get_vs_memcpy{tag}"] = got[f"get{tag}"] / got[f"memcpy{tag}"]
            ratios[f"{path}_set_vs_memcpy{tag}"] = got[f"put{tag}"] / got[f"memcpy{tag}"]
    if sg is not None:
        for tag in ("", "_local"):
            ratios[f"sglang_v2_get_vs_memcpy{tag}"] = sg[f"v2_get{tag}"] / sg[f"v2_memcpy{tag}"]
            ratios[f"sglang_v2_set_vs_memcpy{tag}"] = sg[f"v2_put{tag}"] / sg[f"v2_memcpy{tag}"]
        ratios["sglang_get_vs_file_backend"] = sg["get"] / sg["file_get"]
        ratios["sglang_set_vs_file_backend"] = sg["put"] / sg["file_put"]
    emit("backends", metrics, ratios, args.json,
         notes="ratios without a suffix: the embedded pool; _local: a worker through shared memory; "
               "each against memcpy of the same blocks timed in turn with it")
    return 0
