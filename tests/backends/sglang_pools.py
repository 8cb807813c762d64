"""The installed SGLang, imported once for the SGLang tests (with `sglang_cpu`'s stand-ins, as CI
has no GPU stack), small real host KV pools (the main KV pools and every side pool type of HiCache
v2), and the backend created as SGLang's controller creates it."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import sglang_cpu

sglang_cpu.install()
with sglang_cpu.quiet_import():
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MHATokenToKOnlyPool
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool, LogicalHostPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.observability.metrics_collector import StorageMetrics
    from sglang.srt.runtime_context import get_parallel

    from kvpool.backends.sglang import KVPoolHiCacheStorage

__all__ = ["MHA_LAYOUTS", "MLA_LAYOUTS", "PAGE", "SIDE_POOLS", "HiCacheStorage", "HiCacheStorageConfig",
           "KVPoolHiCacheStorage", "PoolHitPolicy", "PoolName", "PoolTransfer", "StorageBackendFactory",
           "StorageMetrics", "config", "create", "dynamic_extra", "host_pool", "page_bytes", "side_pool"]

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 4
"""Tokens per page of the test pools (3 layers; MHA 2 heads x 8, MLA 16 + 8, bf16)."""


def host_pool(layout: str = "page_first", mla: bool = False, seed: int = 0) -> Any:
    """A 32-page SGLang host pool of random bytes."""
    return sglang_cpu.host_pool(layout, mla=mla, pages=32, page=PAGE, seed=seed)


def dynamic_extra(**options: Any) -> dict[str, Any]:
    """The extra config of `--hicache-storage-backend dynamic` for kvpool, as the examples give it."""
    return {"backend_name": "kvpool", "module_path": "kvpool.backends.sglang",
            "class_name": "KVPoolHiCacheStorage", **options}


def config(mla: bool = False, **fields: Any) -> HiCacheStorageConfig:
    base: dict[str, Any] = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0,
                            "attn_cp_size": 1, "is_mla_model": mla, "enable_storage_metrics": False,
                            "is_page_first_layout": True, "model_name": "org/model"}
    base.update(fields)
    return HiCacheStorageConfig(**base)


def create(host: Any, extra: dict[str, Any] | None = None, **fields: Any) -> Any:
    """The backend as SGLang's cache controller creates it: the factory's dynamic path, then the host
    pool's registration."""
    cfg = config(extra_config=extra or dynamic_extra(), **fields)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    return backend


def page_bytes(host: Any, first_slot: int) -> bytes:
    """Every byte of the page that starts at token slot `first_slot`, in the layout's order."""
    return host.get_data_page(first_slot, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


# ----- HiCache v2 side pools -----------------------------------------------------------------------

def _fill(host: Any, seed: int) -> Any:
    """Random bytes in every data buffer of a side pool (its page accessors then read them back)."""
    rng = np.random.default_rng(seed)
    bufs: list[Any] = []
    for attr in ("kv_buffer", "k_buffer", "temporal_buffer", "conv_buffer", "index_k_with_scale_buffer",
                 "slot_state_buffers"):
        value = getattr(host, attr, None)
        bufs += list(value) if isinstance(value, (list, tuple)) else [value]
    for t in bufs:
        if isinstance(t, torch.Tensor) and t.numel():
            raw = t.view(-1).view(torch.uint8).numpy() if t.is_contiguous() else None
            if raw is not None:
                raw[:] = np.frombuffer(rng.bytes(raw.size), dtype=np.uint8)
    return host


def _mamba(seed: int, side_state: bool = False) -> Any:
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 3, 4, dtype=torch.float32),
                                conv=(torch.zeros(2, 8, 5, 2, dtype=torch.bfloat16),
                                      torch.zeros(2, 8, 3, dtype=torch.bfloat16)),
                                extra_checkpoint_buffers=(torch.zeros(8, 6, dtype=torch.int32),) if side_state else ())
    return MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")


def _dsv4_paged(name: str, layout: str) -> Any:
    return DeepSeekV4PagedHostPool(name, [torch.zeros(16 * PAGE, 48, dtype=torch.uint8) for _ in range(3)], 48,
                                   16, PAGE, layout, device="cpu", pin_memory=False)


def _dsv4_state(name: str, layout: str) -> Any:
    state = [SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=torch.zeros(16, 24, dtype=torch.uint8)),
                             ring_size=PAGE) for _ in range(3)]
    return DeepSeekV4StateHostPool(name, state, 16, PAGE, layout, device="cpu", pin_memory=False)


def _dsa(anchor: Any) -> Any:
    with get_parallel().override(attn_dcp_size=1):
        dev = DSATokenToKVPool(128, 64, 16, torch.bfloat16, 8, 3, "cpu", 128, False, 24)
        return DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dev), anchor, pin_memory=False)


def _index_k(anchor: Any) -> Any:
    dev = MHATokenToKOnlyPool(32 * PAGE, PAGE, torch.bfloat16, 2, 8, 3, "cpu", False)
    return MHATokenToKOnlyPoolHost(dev, anchor, anchor.layout, pin_memory=False)


_DSV4 = [n for n in PoolName if n.value.startswith("deepseek_v4_")]

SIDE_POOLS: dict[str, tuple[PoolName, str]] = {
    **{f"{n.value}": (n, "mha") for n in (PoolName.SWA, PoolName.AUXILIARY_SWA, PoolName.DRAFT, PoolName.DRAFT_SWA)},
    "draft-mla": (PoolName.DRAFT, "mla"),
    "mamba": (PoolName.MAMBA, "mamba"),
    "mamba-with-side-state": (PoolName.MAMBA, "mamba-side"),
    **{n.value: (n, "dsa") for n in (PoolName.INDEXER, PoolName.DRAFT_INDEXER)},
    "indexer-layer_first": (PoolName.INDEXER, "dsa-layer_first"),
    "minimax-index-k": (PoolName.INDEXER, "index-k"),
    **{n.value: (n, "dsv4-state" if n.value.endswith("_state") else "dsv4") for n in _DSV4},
    "deepseek_v4_c4-layer_first": (PoolName.DEEPSEEK_V4_C4, "dsv4-layer_first"),
    "deepseek_v4_c4_state-layer_first": (PoolName.DEEPSEEK_V4_C4_STATE, "dsv4-state-layer_first"),
}
"""Every side pool type of SGLang 0.5.23's PoolName (KV is the anchor) with the host pool class SGLang
builds for it, plus the variants that move differently (case id -> (pool name, kind))."""


def side_pool(kind: str, name: PoolName, seed: int = 0) -> tuple[Any, Any]:
    """(anchor KV host pool, side host pool of `kind`) as SGLang pairs them, filled with random bytes."""
    if kind in ("mha", "mla"):
        return host_pool("page_first", seed=seed + 100), host_pool("page_first", mla=kind == "mla", seed=seed)
    if kind.startswith("mamba"):
        return host_pool("page_first", seed=seed + 100), _fill(_mamba(seed, kind == "mamba-side"), seed)
    if kind.startswith("dsa"):
        layout = "layer_first" if kind.endswith("layer_first") else "page_first"
        anchor = sglang_cpu.host_pool(layout, mla=True, pages=8, page=64, seed=seed + 100)
        return anchor, _fill(_dsa(anchor), seed)
    if kind == "index-k":
        anchor = host_pool("page_first", seed=seed + 100)
        return anchor, _fill(_index_k(anchor), seed)
    layout = "layer_first" if kind.endswith("layer_first") else "page_first"
    side = _dsv4_state(name.value, layout) if kind.startswith("dsv4-state") else _dsv4_paged(name.value, layout)
    return LogicalHostPool(16 * PAGE, PAGE), _fill(side, seed)
