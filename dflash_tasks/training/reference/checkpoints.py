"""Checkpoints in `run_dir/checkpoints/step_XXXXXXXX/`:

- `drafter.safetensors`: the drafter's weights only (the embeddings and LM head are the
  target's, and are not copied), named as z-lab's DFlash drafters name them;
- `config.json`: the drafter as z-lab's DFlash HF config (`DrafterSpec.to_hf_config`: sizes,
  `dflash_config` with the block size, target layers and mask id, the target path), so the
  directory is what SGLang's DFLASH speculative decoding serves
  (`--speculative-draft-model-path`; docs/TRAINING.md; tests/sglang_real loads it with
  SGLang 0.5.23's own parser and weight loader);
- `training_state.pt`: optimizer, scheduler, progress counters and RNG states, for resume.

Each is written into a hidden temporary directory that is then renamed: a directory named
step_* is always complete, whenever the process dies.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_tasks.training.reference.model import Drafter, DrafterSpec

STEP_DIR = re.compile(r"step_(\d{8})")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, drafter: Drafter, state: dict, keep: int) -> Path:
    """Write the checkpoint of `step` atomically, then delete all but the newest `keep`."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a process that died while writing
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()},
              str(tmp / "drafter.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(drafter.spec.to_hf_config(), indent=1))
    torch.save(state, tmp / "training_state.pt")
    tmp.rename(final)
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def read_spec(checkpoint_dir: Path) -> DrafterSpec:
    return DrafterSpec.from_json(json.loads((Path(checkpoint_dir) / "config.json").read_text()))


def load_weights(drafter: Drafter, checkpoint_dir: Path) -> None:
    device = drafter.fc.weight.device
    drafter.load_state_dict(load_file(str(Path(checkpoint_dir) / "drafter.safetensors"),
                                      device=str(device)))


def load_state(checkpoint_dir: Path) -> dict:
    return torch.load(Path(checkpoint_dir) / "training_state.pt", weights_only=True)


def load_drafter(checkpoint_dir: str | Path, target: nn.Module) -> Drafter:
    """A trained drafter from its checkpoint directory, on the target's device, for use with
    that target (its embeddings and LM head)."""
    spec = read_spec(Path(checkpoint_dir))
    if spec.hidden_size != target.config.hidden_size:
        raise ValueError(f"{checkpoint_dir}: the drafter has hidden size {spec.hidden_size}, "
                         f"the target {target.config.hidden_size}: not the target it was "
                         f"trained with ({spec.target_model})")
    drafter = Drafter(spec).to(target.get_input_embeddings().weight.device)
    load_weights(drafter, Path(checkpoint_dir))
    return drafter.eval()
