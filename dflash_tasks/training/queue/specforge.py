"""The command trainer's hand-off to SpecForge 0.2.0: the run config its one public entry point
reads (`specforge train --config FILE`), written by the run from `[command]` values.

SpecForge 0.2.0 has no `scripts/train_dflash.py` any more; its `data` section takes exactly one
of `train_data_path` (raw conversations, rendered by its own chat template), `prompts_path`
(pre-tokenized `input_ids` + `loss_mask`, read as they are) or `hidden_states_path`. The
default is `prompts_path` on the `specforge-tokenized` export: the project's own ids and mask,
exact for every row. Conversations (`format = "specforge-conversations"`) go through SpecForge's
template, which must then be the job's thinking mode's (`template_for`); what it still changes
is in docs/TRAINING_DATA.md.

Every online run in SpecForge 0.2.0 is disaggregated: a patched SGLang capture server computes
the target's hidden states and hands them to the trainer through Mooncake. By default the run
owns both on its node (`managed_local`: a capture server on `capture_gpus`, the trainer on
`trainer_gpus`); with `server_urls` it uses servers started elsewhere. `[command.specforge]`
is merged last into the config, so any SpecForge field can be set.
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import replace
from pathlib import Path

THINKING_TEMPLATE = "qwen3-thinking"
INSTRUCT_TEMPLATE = "qwen3-instruct"
CONFIG_FILE = "specforge.json"  # SpecForge reads JSON as well as YAML: no YAML writer needed

# Why a template other than the mode's own is refused: what SpecForge 0.2.0 would train on.
_WRONG = {
    (True, "qwen"): "SpecForge's 'qwen' template parses messages with its GeneralParser, which "
                    "keeps only role, content and tool_calls: every row's reasoning_content is "
                    "dropped and an empty <think></think> block is trained on in its place",
    (True, INSTRUCT_TEMPLATE): "'qwen3-instruct' parses with the GeneralParser too, which drops "
                               "reasoning_content: the reasoning would not be trained on",
    (False, "qwen"): "'qwen' has no ignore_token, so the empty think block the server put in the "
                     "prompt of a non-thinking row would get loss mask 1",
    (False, THINKING_TEMPLATE): "'qwen3-thinking' has no ignore_token, so the empty think block "
                                "of a non-thinking row's prompt would get loss mask 1",
}


class HandoffError(ValueError):
    """The data and the SpecForge settings do not fit; the message says why and what to do."""


def template_for(requested: str | None, modes: dict[bool, int]) -> str:
    """The SpecForge chat template for a conversations export whose kept rows have these
    thinking modes ({True: rows generated with thinking, False: without}); "auto" (or None)
    picks the mode's. Raises HandoffError for a job that mixes modes or a template that would
    train on tokens the model never generated."""
    thinking, plain = modes.get(True, 0), modes.get(False, 0)
    if thinking and plain:
        raise HandoffError(
            f"the job mixes thinking modes ({thinking:,} rows with thinking, {plain:,} without): "
            "a conversations file is rendered by one SpecForge template, which is right for one "
            "mode only; use format = \"specforge-tokenized\" (exact for both), or one job per mode")
    mode = bool(thinking)
    wanted = THINKING_TEMPLATE if mode else INSTRUCT_TEMPLATE
    if requested in (None, "", "auto", wanted):
        return wanted
    reason = _WRONG.get((mode, requested), f"{requested!r} is not the Qwen3 template SpecForge "
                                           "0.2.0 has for this mode")
    raise HandoffError(f"chat_template {requested!r} refused for "
                       f"{'thinking' if mode else 'non-thinking'} rows: {reason}; use "
                       f"{wanted!r} (chat_template = \"auto\" picks it) or format = "
                       "\"specforge-tokenized\"")


def export_rules(rules, fmt: str, values: dict):
    """The gate's rules for the export a run hands SpecForge. A conversations export leaves
    truncated rows out unless `[command] keep_truncated = true`, whatever [gate] says:
    SpecForge renders each as a finished turn, closed with an `<|im_end|>` (and a `</think>`
    when the cut struck inside the reasoning) that the model never generated, and trains on
    them. The tokenized export keeps the gate's choice: it hands over only generated tokens."""
    if fmt != "specforge-conversations":
        return rules
    return replace(rules, keep_truncated=keep_truncated(values))


def keep_truncated(values: dict) -> bool:
    """`[command] keep_truncated`, which must be a bool (the string "false" is not false)."""
    keep = values.get("keep_truncated", False)
    if not isinstance(keep, bool):
        raise HandoffError(f"[command] keep_truncated: true or false, not {keep!r}")
    return keep


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _gpus(values: dict, name: str, default: list[str]) -> list[str]:
    gpus = values.get(name, default)
    if not isinstance(gpus, list) or not gpus:
        raise HandoffError(f"[command] {name}: a non-empty list of GPU ordinals, like [\"0\"]")
    return [str(g) for g in gpus]


def run_config(values: dict, *, fmt: str, data_path: str | Path, output_dir: str | Path,
               work_dir: str | Path, run_id: str, chat_template: str | None = None,
               warm_start: str | Path | None = None) -> dict:
    """SpecForge's run config (its `Config` sections) for one attempt of a run.

    `work_dir` holds what SpecForge keeps besides checkpoints (its prompt cache, the Mooncake
    control directory); `warm_start`, on an attempt after the first, is the newest checkpoint
    of an earlier one (below: SpecForge 0.2.0 cannot resume an online run's optimizer)."""
    if not values.get("target_model"):
        raise HandoffError("[command] target_model: required by the SpecForge run config "
                           "(model.target_model_path: a local HF directory on the training node)")
    work_dir = Path(work_dir)
    model = {"target_model_path": str(values["target_model"]), "target_backend": "sglang",
             "draft_num_hidden_layers": int(values["drafter_layers"]),
             "draft_block_size": int(values["block_size"])}
    if values.get("draft_config"):
        model["draft_model_config"] = str(values["draft_config"])
    if warm_start:
        model["draft_checkpoint_path"] = str(warm_start)
    if values.get("max_length") is None:  # the run sets the export's longest row (execute.py)
        raise HandoffError("[rules] max_length: none given and no export to take it from")
    data = {"max_length": int(values["max_length"]), "cache_dir": str(work_dir / "cache")}
    if fmt == "specforge-tokenized":
        data["prompts_path"] = str(data_path)  # read as it is: no template involved
    elif fmt == "specforge-conversations":
        data.update(train_data_path=str(data_path),
                    chat_template=chat_template or THINKING_TEMPLATE,
                    # Only the generated turn: earlier assistant turns came from the dataset.
                    train_only_last_turn=True)
    else:
        raise HandoffError(f"[command] format {fmt!r}: SpecForge reads specforge-tokenized "
                           "(prompts_path) or specforge-conversations (train_data_path)")
    training = {"strategy": "dflash", "num_epochs": int(values["epochs"]),
                "learning_rate": float(values["learning_rate"]),
                "num_anchors": int(values["anchors_per_sequence"]),
                "loss_decay_gamma": float(values["decay_gamma"]),
                "save_interval": int(values["checkpoint_every"])}
    nproc = int(values["nproc"])
    disaggregated: dict = {"control_dir": str(work_dir / "control"), "backend": "mooncake"}
    if values.get("server_urls"):  # capture servers and Mooncake run elsewhere
        disaggregated["server_urls"] = [str(u) for u in values["server_urls"]]
    else:
        capture = _gpus(values, "capture_gpus", ["0"])
        trainer = _gpus(values, "trainer_gpus", [str(len(capture) + i) for i in range(nproc)])
        disaggregated["managed_local"] = {
            "trainer_cuda_visible_devices": trainer,
            "capture_servers": [{"port": int(values["capture_port"]),
                                 "cuda_visible_devices": capture, "tp_size": len(capture)}]}
    config = {"model": model, "data": data, "training": training, "run_id": run_id,
              "output_dir": str(output_dir),
              "deployment": {"mode": "disaggregated",
                             "trainer": {"nnodes": 1, "nproc_per_node": nproc},
                             "disaggregated": disaggregated}}
    extra = values.get("specforge") or {}
    if not isinstance(extra, dict):
        raise HandoffError("[command] specforge: must be a table of SpecForge config sections")
    return _merge(config, extra)


def check(config: dict) -> str | None:
    """SpecForge's own verdict on the config (its Config model), when SpecForge is importable
    here; None when it accepts it or is not installed (the training node checks it then)."""
    try:
        from specforge.config import Config
    except ImportError:
        return None
    from pydantic import ValidationError

    try:
        Config.model_validate(config)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(config)"
        return f"SpecForge refuses the run config: {loc}: {err['msg']}"
    return None


def write(config: dict, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, path)
    return path


_STEP_DIR = re.compile(r".+-step\d+")


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest complete SpecForge checkpoint under `directory` (a `<run_id>-step<N>/` holding
    training_state.pt), by time written: steps restart with each attempt's run id."""
    if not directory.is_dir():
        return None
    found = [p for p in directory.iterdir() if _STEP_DIR.fullmatch(p.name) and not p.is_symlink()
             and (p / "training_state.pt").is_file()]
    return max(found, key=lambda p: (p / "training_state.pt").stat().st_mtime, default=None)
