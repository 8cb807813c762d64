"""The installed SGLang, imported once for the SGLang tests (with `kvpool.backends.sglang_cpu`, as CI
has no GPU stack), small real host KV pools, and the backend created as SGLang's controller creates it."""
from __future__ import annotations

from typing import Any

import torch

from kvpool.backends import sglang_cpu

sglang_cpu.install()
with sglang_cpu.quiet_import():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.observability.metrics_collector import StorageMetrics

    from kvpool.backends.sglang import KVPoolHiCacheStorage

__all__ = ["MHA_LAYOUTS", "MLA_LAYOUTS", "PAGE", "HiCacheStorage", "HiCacheStorageConfig", "KVPoolHiCacheStorage",
           "StorageBackendFactory", "StorageMetrics", "config", "create", "dynamic_extra", "host_pool", "page_bytes"]

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
