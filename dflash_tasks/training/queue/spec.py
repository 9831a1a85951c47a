"""A training run's spec: what `manage.py train --config FILE` says, checked before anything is
queued, and stored in the run (the training node does not need the file).

    [rules]       # which rows the run trains on: the gate, the trainer and the export read these
    min_loss_tokens = 32
    max_length = 8192       # unset: every row whole (the job's cap plus its prompt at most)
    long_rows = "cut"       # a row longer: trained on its first max_length tokens ("drop": not)
    keep_truncated = false
    keep_looping = false    # rows whose output ends in a loop (output/loops.py)

    [gate]        # the quality gate that must pass first: `manage.py validate`'s limits
    max_short_share = 0.05
    min_kept_rows = 1000

    [reference]   # --trainer reference: dflash_tasks.training.reference.TrainConfig
    target_model = "/models/Qwen3-8B"
    block_size = 16

    [command]     # --trainer command: SpecForge's run config, and the command's {placeholders}
    template = "specforge"               # the command line: a name the training node defines
    target_model = "/models/Qwen3-8B"
    nproc = 2                            # trainer ranks (GPUs 1-2; the capture server on GPU 0)
    format = "specforge-tokenized"       # the export the run hands over, as {data_path}
    env = { NCCL_DEBUG = "WARN" }        # only names the training node allows
    [command.specforge.training]         # any SpecForge config field, merged last
    batch_size = 4

    [smoke]       # optional, reference trainer (the command trainer ignores it, as [reference]):
                  # the overfit gate, run before training
    rows = 4
    steps = 200
    [eval]        # optional, reference trainer: tau on held-out prompts after every checkpoint
    prompts = "/data/heldout.jsonl"

JSON with the same objects works too. Paths are paths on the training node.

The spec travels through Redis, and whoever can write there could write a spec: so a spec names
its command line and never carries one. The command lines are the training node's own
(`NodeCommands`, from its DFLASH_TRAIN_TEMPLATES file, plus the built-in `specforge`), as are
the environment variables a spec may set; the node checks a spec again before it runs anything.
"""
from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pydantic import ValidationError

from dflash_tasks.training.data.exports import FILES
from dflash_tasks.training.data.gate import Rules, Thresholds
from dflash_tasks.training.reference.config import (
    EvalConfig,
    SmokeConfig,
    TrainConfig,
    read_table,
)

# The command lines every training node runs, by name. `specforge`: SpecForge 0.2.0's one public
# entry point, on a run config the run writes from [command] (training/queue/specforge.py): the
# specforge-tokenized export as its data.prompts_path, so it trains on exactly the project's
# input_ids and loss_mask. A node's DFLASH_TRAIN_TEMPLATES file adds others, or redefines this
# one (another specforge binary).
BUILTIN_TEMPLATES = {"specforge": "specforge train --config {config_path}"}
DEFAULT_TEMPLATE = "specforge"
# What a spec's [command] env may set on every node: tuning knobs that name no file and load no
# code (unlike LD_PRELOAD, PATH, PYTHONPATH, NCCL_NET_PLUGIN...). The node's file adds others.
BUILTIN_ENV = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "PYTORCH_CUDA_ALLOC_CONF",
               "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS")
# SpecForge fields a spec may not set: code from the model's repository, or a secret (a spec is
# stored in Redis, readable by every node: keys belong in the training node's environment).
REFUSED_SPECFORGE = {("model", "trust_remote_code"): "it runs code from the model's repository",
                     ("tracking", "wandb_key"): "a secret: set WANDB_API_KEY on the training node",
                     ("tracking", "swanlab_key"): "a secret: set SWANLAB_API_KEY on the training "
                                                  "node"}

# Values the default command and its run config use, with their defaults (the DFlash recipe's:
# SpecForge's own schema defaults differ, docs/TRAINING.md says which).
COMMAND_DEFAULTS = {"nproc": 1, "block_size": 16,
                    "drafter_layers": 5, "anchors_per_sequence": 512, "decay_gamma": 7.0,
                    "learning_rate": 6e-4,
                    "max_length": None, "epochs": 6, "checkpoint_every": 1000,
                    "capture_port": 30000, "chat_template": "auto",
                    "format": "specforge-tokenized"}
# Filled in by the training task for each run.
RUN_PLACEHOLDERS = ("data_path", "data_dir", "output_dir", "run_dir", "job", "run", "config_path")

SECTIONS = ("rules", "gate", "reference", "command", "smoke", "eval")
_GATE_FIELDS = {f.name for f in fields(Rules)} | {f.name for f in fields(Thresholds)}
# [rules]: a Rules field each (require_tokens follows from the format); where a config written
# before [rules] set the same field, and the trainer's default when none does.
RULE_FIELDS = ("min_loss_tokens", "max_length", "long_rows", "keep_truncated", "keep_looping")
RULE_TYPES = {"min_loss_tokens": (int, 0), "max_length": (int, 2), "long_rows": (str, ("cut", "drop")),
              "keep_truncated": (bool, None), "keep_looping": (bool, None)}
RULES_ALSO_IN = {"reference": ("min_loss_tokens", "max_length", "long_rows", "keep_truncated",
                               "keep_looping"),
                 "command": ("max_length", "keep_truncated")}


class SpecError(ValueError):
    """A bad --config or --template; the message names the file, section and field."""


@dataclass(frozen=True)
class NodeCommands:
    """The command lines a training node runs, by name, and the environment variables a spec may
    set there: the built-in ones plus its DFLASH_TRAIN_TEMPLATES file's."""
    templates: dict[str, str]
    env: frozenset[str]
    source: str = "the built-in templates"

    def template(self, name: str) -> str:
        if name not in self.templates:
            raise SpecError(f"template {name!r} is not one this training node runs (it runs: "
                            f"{', '.join(sorted(self.templates))}; add it to {self.source} as "
                            f'[templates] {name} = "COMMAND LINE")')
        return self.templates[name]

    def name_of(self, command: str) -> str:
        """The name under which this exact command line is allowed."""
        for name, text in self.templates.items():
            if text == command:
                return name
        raise SpecError(f"--command {command!r} is not a command line this training node runs: a "
                        f"run names one of its templates ({', '.join(sorted(self.templates))}); "
                        f"add it to {self.source} as [templates] NAME = \"...\" on the training "
                        "node (and here), then pass --template NAME")

    def check_env(self, env: dict, source: str) -> None:
        refused = sorted(set(env) - self.env)
        if refused:
            raise SpecError(f"{source} [command] env: {', '.join(refused)} may not be set by a "
                            f"run (allowed: {', '.join(sorted(self.env))}; a training node allows "
                            f"more with [env] allow = [...] in {self.source})")


def node_commands(path: Path | None) -> NodeCommands:
    """The node's NodeCommands: the built-in ones, plus those of the TOML file at `path`:

        [templates]                   # NAME = "command line with {placeholders}"
        my-trainer = "python /opt/train.py --data {data_path} --out {output_dir}"
        [env]
        allow = ["NCCL_SOCKET_IFNAME"]
    """
    if path is None:
        return NodeCommands(dict(BUILTIN_TEMPLATES), frozenset(BUILTIN_ENV))
    try:
        data = read_table(path)
    except ValueError as exc:
        raise SpecError(f"DFLASH_TRAIN_TEMPLATES: {exc}") from None
    templates, env = data.get("templates", {}), data.get("env", {})
    unknown = sorted(set(data) - {"templates", "env"}) + sorted(set(env) - {"allow"})
    if unknown:
        raise SpecError(f"{path}: unknown section or field {unknown[0]!r} ([templates], [env] allow)")
    if not (isinstance(templates, dict) and all(isinstance(v, str) for v in templates.values())):
        raise SpecError(f'{path}: [templates] holds NAME = "command line" entries')
    allow = env.get("allow", [])
    if not (isinstance(allow, list) and all(isinstance(v, str) for v in allow)):
        raise SpecError(f"{path}: [env] allow is a list of variable names")
    return NodeCommands({**BUILTIN_TEMPLATES, **templates}, frozenset(BUILTIN_ENV) | set(allow),
                        str(path))


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


def run_gate(config: dict, trainer: str, source: str = "--config") -> tuple[Rules, Thresholds]:
    """The rules and limits a run queued with this config applies in its gate, which `validate
    --config` applies too: one check, one answer for the same rows."""
    _, thresholds = gate_settings({k: v for k, v in config["gate"].items()
                                   if k not in RULE_FIELDS}, f"{source} [gate]")
    return Rules(**resolve_rules(config, trainer, source)), thresholds


def resolve_rules(config: dict, trainer: str, source: str = "--config") -> dict:
    """The run's row rules, from [rules]. A field that [gate] or the trainer's section also sets
    (a config written before [rules]) counts when it says the same, and is an error when it says
    otherwise: the gate and the trainer must keep the same rows. Unset, the trainer's default."""
    section = "reference" if trainer == "reference" else "command"
    unknown = sorted(set(config.get("rules") or {}) - set(RULE_FIELDS))
    if unknown:
        raise SpecError(f"{source} [rules]: unknown field {unknown[0]!r} (fields: "
                        f"{', '.join(RULE_FIELDS)})")
    defaults = {**asdict(Rules()), "max_length": COMMAND_DEFAULTS["max_length"]}
    if trainer == "reference":
        defaults.update({f: TrainConfig.model_fields[f].default for f in RULE_FIELDS})
    rules = {}
    for name in RULE_FIELDS:
        said = {s: (config.get(s) or {})[name] for s in ("rules", "gate", section)
                if name in (config.get(s) or {}) and (s != section or name in RULES_ALSO_IN[s])}
        for where, value in said.items():
            _check_rule(name, value, f"{source} [{where}]")
        if len({json.dumps(v) for v in said.values()}) > 1:
            places = ", ".join(f"[{where}] {name} = {json.dumps(v)}" for where, v in said.items())
            raise SpecError(f"{source}: {places} disagree: the gate and the trainer would keep "
                            f"different rows; set it once, in [rules]")
        rules[name] = next(iter(said.values())) if said else defaults[name]
    return rules


def _check_rule(name: str, value, where: str) -> None:
    kind, least = RULE_TYPES[name]
    if name == "max_length" and value is None:  # JSON's null: every row whole, the default
        return
    if kind is bool and not isinstance(value, bool):
        raise SpecError(f"{where} {name}: true or false, not {value!r}")
    if kind is str and value not in least:
        raise SpecError(f"{where} {name}: one of {', '.join(map(json.dumps, least))}, not {value!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        raise SpecError(f"{where} {name}: an integer >= {least}, not {value!r}")


def run_rules(run_spec: dict) -> Rules:
    """The rules of a queued run, which its gate, its trainer and its export all apply. A spec
    queued before [rules] existed has none: its rules are what its gate used then."""
    if "rules" in run_spec:
        return Rules(**run_spec["rules"])
    gate = dict(run_spec.get("gate") or {})
    if run_spec.get("trainer") == "reference":
        config = TrainConfig.model_validate(run_spec.get("reference") or {})
        gate.setdefault("min_loss_tokens", config.min_loss_tokens)
        gate.setdefault("max_length", config.max_length)
    elif "max_length" in (run_spec.get("command") or {}).get("values", {}):
        gate.setdefault("max_length", run_spec["command"]["values"]["max_length"])
    return gate_settings(gate)[0]


def build(config: dict, trainer: str, template: str | None, source: str = "--config",
          commands: NodeCommands | None = None) -> dict:
    """The run's spec, checked: the reference trainer's config validates; the command trainer's
    template is one of `commands` (the built-in ones by default), its placeholders all have
    values, its env is allowed."""
    commands = commands or node_commands(None)
    gate_settings(config["gate"], f"{source} [gate]")
    if trainer == "command":
        _check_keep_truncated(config["command"], source)
    rules = resolve_rules(config, trainer, source)
    # Every reader gets the same rules: the gate from "rules", the trainer from its own section.
    spec = {"trainer": trainer, "rules": rules, "reference": {}, "command": {},
            "gate": {k: v for k, v in config["gate"].items() if k not in RULE_FIELDS}}
    if trainer == "reference":
        reference_section = {**config["reference"], **rules}
        reference = _validated(TrainConfig, reference_section, source, "reference")
        spec["reference"] = reference_section
        for section, model in (("smoke", SmokeConfig), ("eval", EvalConfig)):
            if config.get(section):
                _validated(model, config[section], source, section)
                spec[section] = config[section]
        if "smoke" in spec:
            threshold = SmokeConfig.model_validate(spec["smoke"]).threshold(reference.block_size)
            if threshold > reference.block_size:
                raise SpecError(f"{source} [smoke] min_tau: {threshold:g} is more than a block "
                                f"of {reference.block_size} can yield (tau <= block_size)")
    else:
        section = {**config["command"], "max_length": rules["max_length"],
                   "keep_truncated": rules["keep_truncated"]}
        name = template or section.pop("template", None) or DEFAULT_TEMPLATE
        section.pop("template", None)
        if "specforge_bin" in section:
            raise SpecError(f"{source} [command] specforge_bin: the command line is the training "
                            "node's: redefine its template there, [templates] specforge = "
                            '"/path/to/specforge train --config {config_path}"')
        values = {**COMMAND_DEFAULTS, **section}
        if values["format"] not in FILES:
            raise SpecError(f"{source} [command] format: {values['format']!r} is not one of "
                            f"{', '.join(FILES)}")
        if values["format"] == "specforge-conversations":
            _check_template(values["chat_template"], source)
        check_command(name, values, commands, source)
        if "{config_path}" in commands.template(name):
            _check_run_config(values, source)
        spec["command"] = {"template": name, "values": values}
    return spec


def _validated(model, section: dict, source: str, name: str):
    try:
        return model.model_validate(section)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(section)"
        raise SpecError(f"{source} [{name}] {loc}: {err['msg']}") from None


def check_command(name: str, values: dict, commands: NodeCommands, source: str) -> str:
    """The command line `name` stands for on this node, checked with the run's values: the
    template is the node's, its placeholders have values, the env and the SpecForge fields are
    allowed. `manage.py train` checks it, and the training node again, with its own commands,
    before it runs anything."""
    env = values.get("env", {})
    if not isinstance(env, dict):
        raise SpecError(f"{source} [command] env: must be a table of NAME = \"value\"")
    commands.check_env(env, source)
    extra = values.get("specforge") or {}
    for (section, field), why in REFUSED_SPECFORGE.items():
        if isinstance(extra, dict) and field in (extra.get(section) or {}):
            raise SpecError(f"{source} [command.specforge.{section}] {field}: not from a run's "
                            f"spec: {why}")
    template = commands.template(name)
    fill_command(template, values, {p: f"<{p}>" for p in RUN_PLACEHOLDERS}, source)
    return template


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

    if values.get("max_length") is None:  # the export's longest row, known when it is written
        values = {**values, "max_length": 2}
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
