"""Test-only stand-in for SGLang's CUDA kernel package `sgl_kernel` (no PyPI build of it has CPU ops).

With `SGLANG_USE_CPU_ENGINE=1` SGLang 0.5.23 imports a few `*_cpu` ops from `sgl_kernel` at import
time; with `--attention-backend torch_native` on a CPU without AMX a dense Llama calls none of them.
Every attribute is a function that raises when called, so a path that does need a kernel fails
loudly instead of computing something else. It is a plain module, not a package: imports of
`sgl_kernel.<sub>` fail with ImportError, which SGLang guards where a CPU run reaches them (it then
uses its own fallbacks, e.g. for `sgl_kernel.scalar_type`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def _missing(name: str) -> Callable[..., NoReturn]:
    def op(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"sgl_kernel.{name} was called, but this sgl_kernel is kvpool's test-only CPU "
                           f"stand-in (tests/e2e/sglang_cpu) without kernels: this path needs a real sgl_kernel")
    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _missing(name)
