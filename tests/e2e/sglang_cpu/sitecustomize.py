"""Test-only patches that let SGLang 0.5.23's HiCache run on a CPU-only machine (kvpool's e2e tests).

Python imports `sitecustomize` at start-up from PYTHONPATH, so every SGLang process of a test (the
driver, the HTTP server, the scheduler subprocesses) installs an import hook that patches these
modules right after they load:
1. `sglang.srt.mem_cache.pool_host.base.HostKVCache.pin_memory` is always False (pinning needs CUDA);
2. `...pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES` 10 GiB -> 1 GiB (SGLang refuses a host pool
   unless that much RAM beyond it is free);
3. `...pool_host.mha.transfer_kv_direct` (layer_first layout, `direct` io) as a torch index copy;
   upstream binds it, and the two below, only on cuda/hip/xpu;
4. `...pool_host.mha.transfer_kv_per_layer_direct_pf_lf` / `transfer_kv_all_layer_direct_lf_pf`
   (page_first_direct layout, which SGLang's own `mooncake` backend switches an MHA model to).
The patches are written against 0.5.23's source: importing any other SGLang version fails loudly.
This directory also holds the `sgl_kernel` stand-in. Nothing here belongs to the kvpool package.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

SGLANG_VERSION = "0.5.23"
HOST_MEMORY_RESERVE_BYTES = 1 << 30

_BASE = "sglang.srt.mem_cache.pool_host.base"
_MHA = "sglang.srt.mem_cache.pool_host.mha"


def _patch_base(mod: types.ModuleType) -> None:
    mod.HICACHE_HOST_MEMORY_RESERVE_BYTES = HOST_MEMORY_RESERVE_BYTES
    # a property: HostKVCache.__init__ assigns self.pin_memory, and every host pool reads it
    mod.HostKVCache.pin_memory = property(lambda self: False, lambda self, value: None)


def _tokens(indices: Any) -> Any:
    import torch
    return indices.to(device="cpu", dtype=torch.int64)


def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any,
                       dst_indices: Any, page_size: int) -> None:
    """Copy token rows `src_indices` of each source layer to rows `dst_indices` of its destination."""
    si, di = _tokens(src_indices), _tokens(dst_indices)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, di, src.index_select(0, si).to(dst.dtype))


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any], src_indices: Any,
                                       dst_indices: Any, layer_id: int, page_size: int) -> None:
    """Host page_first_direct (`[page, layer, page_size, ...]` per K/V) -> one device layer (`[token, ...]`)."""
    si, di = _tokens(src_indices), _tokens(dst_indices)
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst.index_copy_(0, di, src[:, layer_id][si // page_size, si % page_size].to(dst.dtype))


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any], src_indices: Any,
                                       dst_indices: Any, page_size: int) -> None:
    """Every device layer (K layers then V layers) -> host page_first_direct buffers ([K, V], or [KV] for MLA)."""
    si, di = _tokens(src_indices), _tokens(dst_indices)
    layers = len(src_ptrs) // len(dst_ptrs)
    for c, dst in enumerate(dst_ptrs):
        for j in range(layers):
            dst[:, j][di // page_size, di % page_size] = src_ptrs[c * layers + j].index_select(0, si).to(dst.dtype)


def _patch_mha(mod: types.ModuleType) -> None:
    for op in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf):
        setattr(mod, op.__name__, op)  # module globals, looked up when the host pool transfers


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {_BASE: _patch_base, _MHA: _patch_mha}


def _check_version() -> None:
    try:
        found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return  # no installed sglang: the import fails on its own
    if found != SGLANG_VERSION:
        raise ImportError(f"kvpool's SGLang CPU patches (tests/e2e/sglang_cpu) are written for sglang "
                          f"{SGLANG_VERSION}, and this environment has sglang {found}: re-check the patches "
                          f"against that version's source before using them")


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self._inner, name)


class _Hook(importlib.abc.MetaPathFinder):
    """Refuses a foreign SGLang version at `import sglang`; patches the target modules as they load."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "sglang":
            _check_version()
            return None
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> None:
    """Install the hook once (and patch target modules that are already loaded)."""
    if any(type(f).__name__ == "_Hook" and type(f).__module__ == __name__ for f in sys.meta_path):
        return
    if "sglang" in sys.modules:
        _check_version()
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _Hook())


install()
