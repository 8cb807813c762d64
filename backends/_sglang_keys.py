"""Where `KVPoolHiCacheStorage` keeps SGLang's pages: the parts of its pool keys that say which model,
rank share, layout and dtype a page belongs to (`sglang/<model>/<shard>/<layout>/<dtype>/...`)."""
from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName

__all__ = ["page_format", "shard", "side_shard", "split_factor"]


def shard(cfg: HiCacheStorageConfig, replicated: bool | None = None, tp: tuple[int, int] | None = None) -> str:
    """`<shard>/`: which rank's share of a page a key names, as SGLang's file backend tells shards
    apart (TP only for MHA: MLA pages are replicated across TP ranks; `replicated` overrides the
    model's kind, for side pools; `tp` names another (rank, size) than the config's, for a head group)."""
    rank, size = tp or (cfg.tp_rank, cfg.tp_size)
    name = "mla" if (cfg.is_mla_model if replicated is None else replicated) else f"tp{rank}of{size}"
    if cfg.pp_size > 1:
        name += f"-pp{cfg.pp_rank}of{cfg.pp_size}"
    if cfg.attn_cp_size > 1:
        name += f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    if cfg.dcp_size > 1:
        name += f"-tp{cfg.tp_size}-dcp{cfg.dcp_rank}of{cfg.dcp_size}-page{cfg.logical_page_size}"
    return name + "/"


def side_shard(cfg: HiCacheStorageConfig, name: str, host: Any) -> str:
    """A side pool's shard. On a rank-replicated (MLA) model every pool is replicated too, except
    Mamba state (always split across TP ranks) and MHA-shaped pools (an MHA draft model or SWA pool
    on an MLA target), which SGLang's Mooncake backend keys per rank as well."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost, MHATokenToKVPoolHost

    per_rank = name == PoolName.MAMBA.value or isinstance(host, (MHATokenToKVPoolHost, MHATokenToKOnlyPoolHost))
    return shard(cfg, cfg.is_mla_model and not per_rank)


def split_factor(cfg: HiCacheStorageConfig) -> int:
    """Head groups per page when this rank writes for TP size `tp_lcm_size` (0: no split)."""
    lcm: int = cfg.tp_lcm_size or 0
    size: int = cfg.tp_size
    if cfg.is_mla_model or lcm <= 0 or lcm % size:
        return 0
    return lcm // size


def page_format(host: Any) -> str:
    """`<layout>/<dtype>/` of a host pool, the dtype its bytes mean: SGLang stores every fp8 KV format
    as uint8, so a uint8 pool is named by the server's `--kv-cache-dtype` (`kv_cache_dtype`)."""
    dtype = str(getattr(host, "dtype", "")).removeprefix("torch.")
    if dtype == "uint8":
        dtype = kv_cache_dtype() or dtype
    return f"{getattr(host, 'layout', '')}/{dtype}/"


def kv_cache_dtype() -> str | None:
    """The server's `--kv-cache-dtype` as the KV bytes mean it (`auto` stores uint8 only for a checkpoint
    quantized to FP8: e4m3); None where this process has no server arguments to ask."""
    try:
        from sglang.srt.runtime_context import get_server_args

        asked = str(get_server_args().kv_cache_dtype)
    except (ImportError, AttributeError, RuntimeError, ValueError):  # none published in this process (or older SGLang)
        return None
    return "fp8_e4m3" if asked == "auto" else asked
