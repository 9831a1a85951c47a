"""A stand-in for sgl_kernel's CPU build, which is not on PyPI.

SGLang 0.5.23's CPU engine imports a few names from it at start-up (copy_all_layer_kv_cache_cpu,
...) without calling them in the configuration `make test-sglang` launches (torch_native
attention, no CUDA graphs, float32). Every name here is a function that raises if it is ever
called, so a code path that really needs a kernel fails loudly instead of computing garbage.
Installed into .sglang-venv only by tools/sglang_cpu/install.sh.
"""
from __future__ import annotations

__version__ = "0.0.0+dflash-cpu-standin"
STANDIN = True


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called: the dflash-tasks stand-in for sgl_kernel's CPU build "
            f"has no kernels (tools/sglang_cpu/support/sgl_kernel)")
    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
