"""Puts the CPU workarounds into the SGLang environment this interpreter runs in:
the sgl_kernel stand-in (unless a real sgl_kernel is installed) and the torchvision import hook,
loaded through a .pth file so every process SGLang spawns has it."""
from __future__ import annotations

import importlib.util
import shutil
import sysconfig
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent / "support"
site = Path(sysconfig.get_paths()["purelib"])

standin = site / "sgl_kernel"
real = importlib.util.find_spec("sgl_kernel")
if real is None or (standin / "__init__.py").read_text().find("STANDIN = True") >= 0:
    shutil.rmtree(standin, ignore_errors=True)
    shutil.copytree(SUPPORT / "sgl_kernel", standin)
    print(f"sgl_kernel stand-in: {standin}")
shutil.copy(SUPPORT / "dflash_sglang_cpu_hooks.py", site / "dflash_sglang_cpu_hooks.py")
(site / "dflash_sglang_cpu_hooks.pth").write_text("import dflash_sglang_cpu_hooks; dflash_sglang_cpu_hooks.install()\n")
print(f"torchvision hook: {site / 'dflash_sglang_cpu_hooks.pth'}")
