"""A training run's spec: what `manage.py train --config FILE` says, checked before anything is
queued, and stored in the run (the training node does not need the file).

    [gate]        # the quality gate that must pass first: `manage.py validate`'s rules and limits
    min_loss_tokens = 32
    max_short_share = 0.05

    [reference]   # --trainer reference: dflash_tasks.training.TrainConfig
    target_model = "/models/Qwen3-8B"
    block_size = 16

    [command]     # --trainer command: values for the command template's {placeholders}
    target_model = "/models/Qwen3-8B"
    specforge_dir = "/opt/SpecForge"
    format = "specforge-conversations"   # the export the command reads as {data_path}
    env = { CUDA_VISIBLE_DEVICES = "0,1" }

JSON with the same three objects works too. Paths are paths on the training node.
"""
from __future__ import annotations

import string
from dataclasses import fields
from pathlib import Path

from pydantic import ValidationError

from ..training.config import TrainConfig, read_table
from ..training_data.exports import FILES
from ..training_data.gate import Rules, Thresholds

# SpecForge's DFlash trainer (scripts/train_dflash.py) on the export; --resume continues from the
# newest checkpoint in --output-dir, so a run handed back at a worker's shutdown picks up there.
DEFAULT_COMMAND = (
    "torchrun --standalone --nproc_per_node {nproc} {specforge_dir}/scripts/train_dflash.py "
    "--target-model-path {target_model} --train-data-path {data_path} --output-dir {output_dir} "
    "--block-size {block_size} --num-draft-layers {drafter_layers} "
    "--num-anchors {anchors_per_sequence} --loss-decay-gamma {decay_gamma} "
    "--learning-rate {learning_rate} --max-length {max_length} --num-epochs {epochs} "
    "--chat-template {chat_template} --resume")

# Values the default template needs that have a sensible default (SpecForge's own, mostly).
COMMAND_DEFAULTS = {"nproc": 1, "block_size": 16, "drafter_layers": 1,
                    "anchors_per_sequence": 512, "decay_gamma": 7.0, "learning_rate": 6e-4,
                    "max_length": 4096, "epochs": 6, "chat_template": "qwen",
                    "format": "specforge-conversations"}
# Filled in by the training task for each run.
RUN_PLACEHOLDERS = ("data_path", "data_dir", "output_dir", "run_dir", "job", "run")

SECTIONS = ("gate", "reference", "command")
_GATE_FIELDS = {f.name for f in fields(Rules)} | {f.name for f in fields(Thresholds)}


class SpecError(ValueError):
    """A bad --config or --command; the message names the file, section and field."""


def read_config(path: Path | None) -> dict:
    """The file's sections (missing ones empty); raises SpecError naming what is wrong."""
    if path is None:
        return {s: {} for s in SECTIONS}
    try:
        data = read_table(path)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise SpecError(f"{path}: unknown section {unknown[0]!r} (sections: {', '.join(SECTIONS)})")
    for s in SECTIONS:
        if not isinstance(data.get(s, {}), dict):
            raise SpecError(f"{path}: [{s}] must be a table")
    return {s: dict(data.get(s, {})) for s in SECTIONS}


def gate_settings(section: dict, where: str = "[gate]") -> tuple[Rules, Thresholds]:
    unknown = sorted(set(section) - _GATE_FIELDS)
    if unknown:
        raise SpecError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(_GATE_FIELDS))})")
    rule_names = {f.name for f in fields(Rules)}
    try:
        return (Rules(**{k: v for k, v in section.items() if k in rule_names}),
                Thresholds(**{k: v for k, v in section.items() if k not in rule_names}))
    except TypeError as exc:
        raise SpecError(f"{where}: {exc}") from None


def build(config: dict, trainer: str, command: str | None, source: str = "--config") -> dict:
    """The run's spec, checked: the reference trainer's config validates, the command template's
    placeholders all have values."""
    spec = {"trainer": trainer, "gate": config["gate"], "reference": {}, "command": {}}
    gate_settings(config["gate"], f"{source} [gate]")
    if trainer == "reference":
        try:
            TrainConfig.model_validate(config["reference"])
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "(section)"
            raise SpecError(f"{source} [reference] {loc}: {err['msg']}") from None
        spec["reference"] = config["reference"]
    else:
        section = dict(config["command"])
        template = command or section.pop("template", None) or DEFAULT_COMMAND
        section.pop("template", None)
        values = {**COMMAND_DEFAULTS, **section}
        if values["format"] not in FILES:
            raise SpecError(f"{source} [command] format: {values['format']!r} is not one of "
                            f"{', '.join(FILES)}")
        if not isinstance(values.get("env", {}), dict):
            raise SpecError(f"{source} [command] env: must be a table of NAME = \"value\"")
        fill_command(template, values, {p: f"<{p}>" for p in RUN_PLACEHOLDERS}, source)
        spec["command"] = {"template": template, "values": values}
    return spec


def fill_command(template: str, values: dict, run_values: dict, source: str = "the run") -> str:
    """The template with its {placeholders} filled; SpecError names a placeholder without one."""
    merged = {**values, **run_values}
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise SpecError(f"command template {template!r}: {exc}") from None
    missing = [name for name in dict.fromkeys(names)
               if not name or name.split(".")[0].split("[")[0] not in merged]
    if missing:
        listed = ", ".join("{" + m + "}" for m in missing)
        raise SpecError(f"command template: {listed} ha{'ve' if len(missing) > 1 else 's'} no "
                        f"value: set {' and '.join(missing)} in {source}'s [command] section "
                        f"(filled in for each run: {', '.join(RUN_PLACEHOLDERS)})")
    return template.format_map(merged)
