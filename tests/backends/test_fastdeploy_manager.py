"""FastDeploy's own cache transfer manager code, patched by `kvpool fastdeploy enable`, driving KVPoolStore.

The storage methods of `CacheTransferManager` (`_init_storage`, `_init_storage_buffer`,
`write_back_storage_task`, `read_storage_task` and the `_run_*` helpers they call) are compiled from
the verbatim fixture file after patching; only what needs paddle or a GPU is replaced: pinned
allocation (`cuda_host_alloc`, here numpy) and `swap_cache_layout` (the GPU<->host block copy, here a
numpy copy with the same layout: host block = [layer][head][token][dim]).
"""
from __future__ import annotations

import ast
import ctypes
import enum
import logging
import os
import shutil
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvpool.backends import fastdeploy_patch as fp
from kvpool.backends._hostio import model_part
from kvpool.backends.fastdeploy import KVPoolStore

from bkhelp import FASTDEPLOY_SRC, SMALL_ENV, payload

METHODS = ("_init_storage", "_init_storage_buffer", "_run_read_storage", "read_storage_task",
           "_run_write_back_storage", "write_back_storage_task")

LAYERS, HEADS, BLOCK, DIM, GPU_BLOCKS = 3, 2, 16, 32, 10


class CacheStatus(enum.Enum):
    STORAGE2GPU = "storage2gpu"
    GPU2STORAGE = "gpu2storage"


class ReadStorageTask(SimpleNamespace):
    pass


class WriteStorageTask(SimpleNamespace):
    pass


class _Host:
    """`cuda_host_alloc` stand-in: numpy allocations kept alive, handed out by address."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def alloc(self, nbytes: int) -> int:
        a = np.zeros(nbytes, dtype=np.uint8)
        self.arrays.append(a)
        return int(a.ctypes.data)


def swap_cache_layout(tensors: list[np.ndarray], cpu_ptr: int, shape: Any, gpu_ids: list[int],
                      cpu_ids: list[int], device: int, mode: int) -> None:
    """mode 0: GPU blocks -> host blocks; mode 1: host -> GPU. A host block holds every layer of one block."""
    if not gpu_ids:
        return
    layer_bytes = tensors[0][0].nbytes
    stride = layer_bytes * len(tensors)
    host = np.ctypeslib.as_array((ctypes.c_uint8 * (stride * (max(cpu_ids) + 1))).from_address(cpu_ptr))
    for g, c in zip(gpu_ids, cpu_ids):
        for layer, t in enumerate(tensors):
            span = slice(c * stride + layer * layer_bytes, c * stride + (layer + 1) * layer_bytes)
            if mode == 0:
                host[span] = t[g].reshape(-1).view(np.uint8)
            else:
                t[g].reshape(-1).view(np.uint8)[:] = host[span]


class _Barrier:
    def wait(self) -> None:
        pass

    def reset(self) -> None:
        pass


class _Queue:
    def __init__(self) -> None:
        self.swap_storage_to_gpu_barrier = _Barrier()
        self.swap_to_storage_barrier = _Barrier()
        self.done: list[tuple[Any, ...]] = []

    def put_transfer_done_signal(self, result: tuple[Any, ...]) -> None:
        self.done.append(result)


def manager_class(pkg: Path, host: _Host) -> type:
    """A class holding the patched manager's storage methods, compiled from the patched file."""
    path = pkg / fp.MANAGER_FILE
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheTransferManager")
    funcs = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in METHODS]
    assert {f.name for f in funcs} == set(METHODS)
    log = logging.getLogger("fastdeploy.cache_transfer_manager")

    class NotHere:
        def __init__(self, *a: Any, **kw: Any) -> None:
            raise AssertionError("a FastDeploy backend other than kvpool was constructed")

    ns: dict[str, Any] = {
        "os": os, "time": time, "traceback": traceback, "List": list, "logger": log, "console_logger": log,
        "CacheStatus": CacheStatus, "ReadStorageTask": ReadStorageTask, "WriteStorageTask": WriteStorageTask,
        "MooncakeStore": NotHere, "AttentionStore": NotHere, "FileStore": NotHere,
        "get_key_prefix_from_version": lambda path: "", "cuda_host_alloc": host.alloc,
        "swap_cache_layout": swap_cache_layout,
    }
    exec(compile(ast.Module(funcs, []), str(path), "exec"), ns)
    return type("PatchedStorageMethods", (), {name: ns[name] for name in METHODS})


def make_manager(pkg: Path, tmp_path: Path, fp8: bool) -> Any:
    host = _Host()
    m = manager_class(pkg, host)()
    m.host = host
    m.rank, m.n_ranks, m.device, m.local_data_parallel_id = 0, 1, 0, 0
    m.model_id = "ERNIE-4.5-0.3B-Paddle"
    m.num_layers, m.num_extra_layers, m.block_size, m.head_num, m.head_dim = LAYERS, 0, BLOCK, HEADS, DIM
    m.cache_item_bytes, m.scale_item_bytes, m.has_cache_scale = (1, 4, True) if fp8 else (2, 4, False)
    m.cache_dtype = "block_wise_fp8" if fp8 else "bfloat16"
    m.key_cache_shape = m.value_cache_shape = [GPU_BLOCKS, HEADS, BLOCK, DIM]
    m.cache_scale_shape = [GPU_BLOCKS, HEADS, BLOCK]
    layer_block = (GPU_BLOCKS, HEADS * BLOCK * DIM * m.cache_item_bytes)
    scale_block = (GPU_BLOCKS, HEADS * BLOCK * m.scale_item_bytes)
    m.gpu_cache_k_tensors = [np.zeros(layer_block, np.uint8) for _ in range(LAYERS)]
    m.gpu_cache_v_tensors = [np.zeros(layer_block, np.uint8) for _ in range(LAYERS)]
    m.gpu_cache_scales_k_tensors = [np.zeros(scale_block, np.uint8) for _ in range(LAYERS)]
    m.gpu_cache_scales_v_tensors = [np.zeros(scale_block, np.uint8) for _ in range(LAYERS)]
    m.cache_task_queue = _Queue()
    args = SimpleNamespace(kvcache_storage_backend="kvpool", write_policy="write_through",
                           model_path=str(tmp_path / m.model_id), max_model_len=BLOCK * 8)
    m._init_storage(args)
    return m


def gpu_tensors(m: Any) -> list[list[np.ndarray]]:
    groups = [m.gpu_cache_k_tensors, m.gpu_cache_v_tensors]
    return groups + [m.gpu_cache_scales_k_tensors, m.gpu_cache_scales_v_tensors] if m.has_cache_scale else groups


@pytest.fixture
def patched_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "fastdeploy"
    shutil.copytree(FASTDEPLOY_SRC, pkg)
    fp.enable(pkg)
    for name, value in SMALL_ENV.items():  # the patched branch builds its pool from KVPOOL_* settings
        monkeypatch.setenv(name, value)
    return pkg


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "block_wise_fp8"])
def test_write_back_then_read_through_fastdeploy_code(patched_pkg: Path, tmp_path: Path, fp8: bool,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    m = make_manager(patched_pkg, tmp_path, fp8)
    try:
        assert isinstance(m.storage_backend, KVPoolStore) and m.storage_backend_type == "kvpool"
        model = model_part(str(tmp_path / "ERNIE-4.5-0.3B-Paddle"))  # the model's path, as FastDeploy was given it
        assert m.storage_backend.namespace == model
        assert m.storage_backend._prefix == f"{model}/tp1/{m.cache_dtype}/"  # the layout names the keys
        assert len(m.storage_backend._io.buffers) == (4 if fp8 else 2)
        for group in gpu_tensors(m):
            for layer, t in enumerate(group):
                t[:] = payload(f"{id(group)}/{layer}", t.nbytes).reshape(t.shape)
        original = [[t.copy() for t in group] for group in gpu_tensors(m)]
        hashes = ["a1", "b2", "c3", "d4"]
        written_ids = [5, 2, 7, 9]

        with caplog.at_level(logging.ERROR, logger="fastdeploy.cache_transfer_manager"):
            m.write_back_storage_task(WriteStorageTask(task_id="w", keys=hashes, token_ids=list(range(64)),
                                                       gpu_block_ids=written_ids, timeout=1.0))
            assert m.cache_task_queue.done[-1] == (CacheStatus.GPU2STORAGE, "w", hashes, written_ids)
            suffixes = ["key", "value", "key_scale", "value_scale"] if fp8 else ["key", "value"]
            assert all(m.storage_backend.exists([f"prefix_{h}_0_{s}" for h in hashes for s in suffixes]).values())

            for group in gpu_tensors(m):
                for t in group:
                    t[:] = 0
            read_ids = [1, 3, 4, 6, 0]
            m.read_storage_task(ReadStorageTask(task_id="r", keys=hashes + ["e5"], token_ids=list(range(80)),
                                                gpu_block_ids=read_ids, start_read_block_idx=0, timeout=1.0))
            assert m.cache_task_queue.done[-1] == (CacheStatus.STORAGE2GPU, "r", hashes + ["e5"], [1, 3, 4, 6])
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

        for group, before in zip(gpu_tensors(m), original):
            for t, t0 in zip(group, before):
                for src, dst in zip(written_ids, read_ids):
                    assert np.array_equal(t[dst], t0[src])  # every byte of every layer came back
                assert not t[0].any()                        # the unmatched block was not touched
    finally:
        m.storage_backend.close()


def test_pool_down_read_task_completes_with_no_blocks(patched_pkg: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_MODE", "local")
    monkeypatch.setenv("KVPOOL_WORKER", str(tmp_path / "no-worker.sock"))
    m = make_manager(patched_pkg, tmp_path, fp8=False)
    try:
        m.write_back_storage_task(WriteStorageTask(task_id="w", keys=["a"], token_ids=list(range(16)),
                                                   gpu_block_ids=[1], timeout=1.0))
        m.read_storage_task(ReadStorageTask(task_id="r", keys=["a"], token_ids=list(range(16)),
                                            gpu_block_ids=[2], start_read_block_idx=0, timeout=1.0))
        assert m.cache_task_queue.done[-1] == (CacheStatus.STORAGE2GPU, "r", ["a"], [])
    finally:
        m.storage_backend.close()
