"""SGLang's HiCache modules and host KV pools on a CPU-only machine (CI, `kvpool bench backends`).

Test scaffolding, never installed with kvpool: the SGLang tests import it as `sglang_cpu` (this folder
is on their path), and `kvpool bench backends` loads this file from a kvpool checkout at run time
(`--sglang-cpu`, default this path).

The kvpool adapter itself needs none of this: on a GPU machine SGLang's own stack (triton, a CUDA
torchvision) is installed. Without it, `sglang.srt.utils.common` does `import triton` at module level
and `sglang.srt.configs` (pulled in by the host KV pools) imports `torchvision.transforms`; PyPI's
torchvision is CUDA-linked and cannot load beside the CPU torch wheel. `install()` fills both gaps
with inert stand-ins, before the first `import sglang...`; each is skipped where the real package
is importable. Nothing on the KV-cache paths calls into either. `host_pool` builds SGLang's real host
KV pools there, as SGLang builds them from a device pool.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["host_pool", "install", "quiet_import"]


class _Dummy:
    """Any torchvision object referenced at import time; calling one is an error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchvision is stubbed out by tests/backends/sglang_cpu.py (CPU-only SGLang import)")

    def __getattr__(self, name: str) -> str:  # e.g. InterpolationMode.BICUBIC in a default argument
        if name.startswith("__"):
            raise AttributeError(name)
        return name


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)  # no __version__ / __file__: nothing mistakes it for the real one
        cls = type(name, (_Dummy,), {})
        setattr(self, name, cls)
        return cls


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `root` and every `root.*` submodule to a `_StubModule`."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _stub_torchvision() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    try:  # transformers caches "is torchvision available": let it cache the truth (False) first
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except ImportError:
        pass
    sys.meta_path.insert(0, _StubFinder("torchvision"))


def _stub_triton() -> None:
    """Replay the triton stand-in SGLang ships for Apple silicon (`sglang/_platform_stubs.py`, which
    SGLang installs only on macOS): load that file by path, register its finder, and fill in the
    attributes that SGLang's kernel modules touch at import time."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return  # no SGLang: nothing will import triton through it
    path = os.path.join(next(iter(spec.submodule_search_locations)), "_platform_stubs.py")
    stubs_spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", path)
    assert stubs_spec is not None and stubs_spec.loader is not None
    stubs = importlib.util.module_from_spec(stubs_spec)
    sys.modules["_sglang_platform_stubs"] = stubs  # its dataclasses look their module up by name
    stubs_spec.loader.exec_module(stubs)
    mock = stubs._make_mock

    class _constexpr:
        def __init__(self, value: Any = None) -> None:
            self.value = value

    def classes(module: Any, base: type, *names: str) -> None:
        for name in names:
            setattr(module, name, type(name, (base,), {}))

    sys.meta_path.insert(0, stubs._TritonFinder())
    triton = mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv, triton.next_power_of_2, triton.Config = stubs._cdiv, stubs._next_power_of_2, stubs._Config
    triton.language = tl = mock("triton.language")
    tl.constexpr = _constexpr
    tl.extra = mock("triton.language.extra")
    tl.extra.libdevice = mock("triton.language.extra.libdevice")
    triton.runtime = runtime = mock("triton.runtime")
    runtime.jit = mock("triton.runtime.jit")
    classes(runtime.jit, object, "JITFunction")
    classes(runtime.jit, stubs._StubBase, "KernelInterface")
    runtime.cache = mock("triton.runtime.cache")
    runtime.cache.triton_key = stubs._triton_key
    runtime.autotuner = mock("triton.runtime.autotuner")
    classes(runtime.autotuner, Exception, "OutOfResources", "PTXASError")
    runtime.driver = mock("triton.runtime.driver")
    triton.compiler = mock("triton.compiler")
    classes(triton.compiler, stubs._StubBase, "CompiledKernel")
    triton.compiler.compiler = mock("triton.compiler.compiler")
    classes(triton.compiler.compiler, stubs._StubBase, "ASTSource")
    triton.compiler.compiler.triton_key = stubs._triton_key
    triton.testing = mock("triton.testing")
    triton.tools = mock("triton.tools")
    triton.tools.tensor_descriptor = mock("triton.tools.tensor_descriptor")
    triton.backends = mock("triton.backends")
    triton.backends.compiler = mock("triton.backends.compiler")
    classes(triton.backends.compiler, stubs._StubBase, "GPUTarget")


def install() -> None:
    """Stand in for triton and torchvision where they are not importable; idempotent. Call it before
    the first `import sglang...`. Do not use `torch.compile` in the same process afterwards."""
    _stub_triton()
    _stub_torchvision()


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Ignore, inside the block only, the warnings SGLang's first import emits that are not ours:
    torch.jit deprecations (SGLang applies torch.compile decorators at import time) and "only CUDA
    supports ..." from its quantization modules. Tests run with warnings as errors."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit\._script")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.srt\.layers\.quantization\.")
        yield


def host_pool(layout: str = "page_first", *, mla: bool = False, pages: int = 32, page: int = 4, layers: int = 3,
              heads: int = 2, head_dim: int = 8, kv_lora_rank: int = 16, rope_dim: int = 8,
              dtype: Any = None, seed: int = 0) -> Any:
    """A real SGLang host KV pool (MHA, or MLA with `kv_lora_rank + rope_dim` per token) of `pages`
    pages of `page` tokens, filled with random bytes (bf16 by default). Built from a one-page device
    pool's buffer info, as SGLang builds it, with `pin_memory=False` (pinning needs CUDA)."""
    import torch

    install()
    with quiet_import():
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = torch.bfloat16 if dtype is None else dtype
    last = layers - 1
    common: dict[str, Any] = {"pin_memory": False, "start_layer": 0, "end_layer": last,
                              "host_token_capacity": pages * page}
    if mla:
        dev: Any = MLATokenToKVPool(page, page, dtype, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim,
                                    layer_num=layers, device="cpu", enable_memory_saver=False, start_layer=0,
                                    end_layer=last)
        host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, page, layout,
                                    device_capacity_tokens=dev.size, target_layer_num=layers,
                                    override_kv_cache_dim=dev.kv_cache_dim, **common)
    else:
        dev = MHATokenToKVPool(page, page, dtype, head_num=heads, head_dim=head_dim, layer_num=layers,
                               device="cpu", enable_memory_saver=False, start_layer=0, end_layer=last)
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, page, layout,
                                    device_capacity_tokens=dev.size, **common)
    raw = host.kv_buffer.view(-1).view(torch.uint8).numpy()
    rng = np.random.default_rng(seed)
    for start in range(0, raw.size, 64 << 20):  # random bytes (any bit pattern: pages move as bytes)
        end = min(start + (64 << 20), raw.size)
        raw[start:end] = np.frombuffer(rng.bytes(end - start), dtype=np.uint8)
    return host
