"""Import hooks that let SGLang 0.5.23 start on CPU-only torch; loaded at interpreter start by
dflash_sglang_cpu_hooks.pth in .sglang-venv (so SGLang's spawned scheduler and detokenizer
processes get them too). Installed only by tools/sglang_cpu/install.sh.

torchvision: PyPI's torchvision 0.28.0 is a CUDA build whose compiled ops do not register
against the CPU torch, and its _meta_registrations then fails with "operator torchvision::nms
does not exist" (transformers and SGLang's multimodal processors import torchvision at start-up).
Defining the two op schemas it registers fake kernels for (nms, qnms) before torchvision loads
gets past it; calling them would still fail, and nothing here does.
"""
from __future__ import annotations

import importlib.abc
import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBS = []


def _define_schemas() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}") and not _has_schema(name):
            lib.define(schema)
    _LIBS.append(lib)  # a Library's definitions live as long as the object


def _has_schema(name: str) -> bool:
    import torch

    try:
        torch._C._get_schema(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


class _TorchvisionFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_schemas()
        return None  # the normal finders import torchvision itself


def install() -> None:
    if not any(isinstance(f, _TorchvisionFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFirst())
