"""A training run's spec: what `manage.py train --config FILE` says, checked before anything is
queued, and stored in the run (the training node does not need the file).

    [gate]        # the quality gate that must pass first: `manage.py validate`'s rules and limits
    min_loss_tokens = 32
    max_short_share = 0.05

    [reference]   # --trainer reference: dflash_tasks.training.reference.TrainConfig
    target_model = "/models/Qwen3-8B"
    block_size = 16

    [command]     # --trainer command: SpecForge's run config, and the command's {placeholders}
    target_model = "/models/Qwen3-8B"
    nproc = 2                            # trainer ranks (GPUs 1-2; the capture server on GPU 0)
    format = "specforge-tokenized"       # the export the run hands over, as {data_path}
    env = { NCCL_DEBUG = "WARN" }
    [command.specforge.training]         # any SpecForge config field, merged last
    batch_size = 4

JSON with the same three objects works too. Paths are paths on the training node.
"""
from __future__ import annotations

import string
from dataclasses import fields
from pathlib import Path

from pydantic import ValidationError

from dflash_tasks.training.data.exports import FILES
from dflash_tasks.training.data.gate import Rules, Thresholds
from dflash_tasks.training.reference.config import TrainConfig, read_table

# SpecForge 0.2.0's one public entry point, on a run config the run writes from [command]
# (training/queue/specforge.py): the specforge-tokenized export as its data.prompts_path, so it
# trains on exactly the project's input_ids and loss_mask.
DEFAULT_COMMAND = "{specforge_bin} train --config {config_path}"

# Values the default command and its run config use, with their defaults (the DFlash recipe's:
# SpecForge's own schema defaults differ, docs/TRAINING.md says which).
COMMAND_DEFAULTS = {"specforge_bin": "specforge", "nproc": 1, "block_size": 16,
                    "drafter_layers": 1, "anchors_per_sequence": 512, "decay_gamma": 7.0,
                    "learning_rate": 6e-4,
                    "max_length": 4096, "epochs": 6, "checkpoint_every": 1000,
                    "capture_port": 30000, "chat_template": "auto",
                    "format": "specforge-tokenized"}
# Filled in by the training task for each run.
RUN_PLACEHOLDERS = ("data_path", "data_dir", "output_dir", "run_dir", "job", "run", "config_path")

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
        if values["format"] == "specforge-conversations":
            _check_template(values["chat_template"], source)
        _check_keep_truncated(values, source)
        if "{config_path}" in template:
            _check_run_config(values, source)
        fill_command(template, values, {p: f"<{p}>" for p in RUN_PLACEHOLDERS}, source)
        spec["command"] = {"template": template, "values": values}
    return spec


def _check_keep_truncated(values: dict, source: str) -> None:
    from dflash_tasks.training.queue.specforge import HandoffError, keep_truncated

    try:
        keep_truncated(values)
    except HandoffError as exc:
        raise SpecError(f"{source} {exc}") from None


def _check_template(requested: str, source: str) -> None:
    """A conversations run's chat_template must be right for at least one thinking mode (the
    job's is known when the run starts, and checked then)."""
    from dflash_tasks.training.queue.specforge import HandoffError, template_for

    try:
        template_for(requested, {True: 1})
        return
    except HandoffError as thinking:
        try:
            template_for(requested, {False: 1})
        except HandoffError:
            raise SpecError(f"{source} [command] {thinking}") from None


def _check_run_config(values: dict, source: str) -> None:
    """The SpecForge run config these values make, with stand-in paths, accepted by SpecForge's
    own Config when it is installed here."""
    from dflash_tasks.training.queue.specforge import HandoffError, check, run_config

    try:
        config = run_config(values, fmt=values["format"], data_path="<data_path>",
                            output_dir="<output_dir>", work_dir="<run_dir>/specforge",
                            run_id="<run>", chat_template=None)
    except HandoffError as exc:
        raise SpecError(f"{source} {exc}") from None
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{source} [command]: {exc}") from None
    if (problem := check(config)) is not None:
        raise SpecError(f"{source} [command]: {problem} (set it with [command.specforge])")


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
