"""`train-eval`: a reference checkpoint's mean acceptance length tau and acceptance by block
position on held-out prompts (training/reference/heldout.py), as a table and a JSON report."""
from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table

from dflash_tasks.cli.common import console, file_to_write
from dflash_tasks.core.keys import JobName

CHECKPOINT_FILES = ("config.json", "drafter.safetensors")


def _settings(config: Path | None, spec_eval: dict | None, overrides: dict):
    """[eval] from --config, else the run's spec, with the command line's options on top."""
    from pydantic import ValidationError

    from dflash_tasks.training.queue.spec import SpecError, read_config
    from dflash_tasks.training.reference.config import EvalConfig

    section = dict(spec_eval or {})
    if config is not None:
        try:
            section = read_config(config)["eval"]
        except SpecError as exc:
            raise click.BadParameter(str(exc), param_hint="--config") from None
    section.update({k: v for k, v in overrides.items() if v is not None})
    if "prompts" not in section:
        raise click.UsageError("no held-out prompts: pass --prompts FILE, or a --config whose "
                               "[eval] section names them (prompts = \"...\")")
    try:
        return EvalConfig.model_validate(section)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(section)"
        raise click.BadParameter(f"[eval] {where}: {err['msg']}",
                                 param_hint="--config" if config else "options") from None


def _checkpoint_of_run(run, step: int | None) -> Path:
    from dflash_tasks.core.settings import get_settings
    from dflash_tasks.training.reference.checkpoints import checkpoint_dirs

    if run.trainer != "reference":
        raise click.ClickException(f"run {run.name} used the {run.trainer} trainer: train-eval "
                                   "measures the reference trainer's checkpoints")
    run_dir = Path(run.get("run_dir") or get_settings().training_dir() / run.name)
    found = checkpoint_dirs(run_dir)
    if step is not None:
        found = [p for p in found if p.name == f"step_{step:08d}"]
    if not found:
        which = f"checkpoint of step {step}" if step is not None else "checkpoint"
        raise click.ClickException(f"run {run.name}: no {which} in {run_dir / 'checkpoints'} "
                                   "on this machine (train-status --run lists its checkpoints)")
    return found[-1]


def _check_checkpoint(path: Path) -> Path:
    missing = [f for f in CHECKPOINT_FILES if not (path / f).is_file()]
    if missing:
        raise click.BadParameter(f"{path} is not a reference checkpoint directory (no "
                                 f"{' and no '.join(missing)})", param_hint="--checkpoint")
    return path


def _print(report: dict, out: Path) -> None:
    table = Table(title=f"acceptance of {report['checkpoint']}")
    table.add_column("block position k", justify="right")
    table.add_column("acceptance (m >= k)", justify="right")
    for k, a in enumerate(report["acceptance_by_position"], start=1):
        table.add_row(str(k), "-" if a is None else f"{a:.3f}")
    console.print(table)
    mode = "thinking" if report["enable_thinking"] else "non-thinking"
    console.print(f"tau {report['tau']:.3f} of {report['block_size']} (tokens per verification "
                  f"step, the bonus token counted; the mean of the prompts' own), pooled "
                  f"{report['tau_pooled']:.3f}: {report['tokens']:,} tokens in "
                  f"{report['steps']:,} steps over {report['prompts']} held-out prompts, "
                  f"temperature {report['temperature']:g}, {mode}\nreport: {out}",
                  highlight=False)


@click.command("train-eval")
@click.option("--run", "run_name", help="A reference run: its newest checkpoint (or --step).")
@click.option("--step", type=click.IntRange(min=1), help="With --run: that step's checkpoint.")
@click.option("--checkpoint", type=click.Path(path_type=Path),
              help="A checkpoint directory (drafter.safetensors, config.json).")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A training config whose [eval] section to use.", show_default="the run's")
@click.option("--prompts", help="Held-out prompts: a JSONL or Parquet dataset [[eval] prompts].")
@click.option("--max-prompts", type=click.IntRange(min=1), help="Prompts measured.",
              show_default="the [eval] section's, else 32")
@click.option("--max-new-tokens", type=click.IntRange(min=2), help="Answer cap.",
              show_default="the [eval] section's, else 2048 (z-lab's benchmark)")
@click.option("--temperature", type=click.FloatRange(min=0),
              help="The target's sampling temperature; 0: greedy.",
              show_default="the [eval] section's, else 0")
@click.option("--thinking/--no-thinking", default=None,
              help="The chat template's thinking mode.", show_default="the run's rows'")
@click.option("--target", type=click.Path(path_type=Path),
              help="The target model directory.", show_default="the one the checkpoint names")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--out", metavar="FILE.json", callback=file_to_write(".json"),
              help="The JSON report.", show_default="CHECKPOINT/eval.json")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def train_eval(run_name: str | None, step: int | None, checkpoint: Path | None,
               config: Path | None, prompts: str | None, max_prompts: int | None,
               max_new_tokens: int | None, temperature: float | None, thinking: bool | None,
               target: Path | None, device: str, out: Path | None, as_json: bool) -> None:
    """Mean acceptance length tau (tokens per verification step, the bonus token counted, as in
    the DFlash and DSpark papers) and acceptance by block position of a reference checkpoint,
    on held-out prompts answered by the target itself (docs/TRAINING.md)."""
    from dflash_tasks.training.data.tokens import ChatTemplate, TokenizeError
    from dflash_tasks.training.reference import heldout
    from dflash_tasks.training.reference.checkpoints import read_spec
    from dflash_tasks.training.reference.config import TrainConfig

    if (run_name is None) == (checkpoint is None):
        raise click.UsageError("pass --run NAME or --checkpoint PATH")
    if step is not None and run_name is None:
        raise click.UsageError("--step goes with --run")
    run, rows, reference = None, None, {}
    if run_name:
        from dflash_tasks.cli.common import output_storage, redis_or_fail
        from dflash_tasks.training.data.reader import NewestRows, NoManifest
        from dflash_tasks.training.queue import runs

        r = redis_or_fail()
        run = runs.load(r, run_name)
        if run is None:
            raise click.ClickException(f"no training run named {run_name!r} "
                                       "(`manage.py train-status` lists them)")
        checkpoint = _checkpoint_of_run(run, step)
        reference = run.spec.get("reference") or {}
        try:
            job = JobName(run.job)  # as the run's record in Redis has it
            storage = output_storage(None, job, r)
            rows = list(NewestRows(storage, job, limit=64))
        except NoManifest as exc:
            raise click.ClickException(f"run {run.name}: its job's rows, for the thinking "
                                       f"contract: {exc}") from None
    checkpoint = _check_checkpoint(Path(checkpoint))
    settings = _settings(config, run.spec.get("eval") if run else None,
                         {"prompts": prompts, "max_prompts": max_prompts,
                          "max_new_tokens": max_new_tokens, "temperature": temperature,
                          "enable_thinking": thinking})
    try:
        mode = heldout.check_thinking_contract(rows or [], settings) if rows is not None \
            else (True if settings.enable_thinking is None else settings.enable_thinking)
        questions = heldout.load_prompts(settings)
        if run is not None:  # every row of the job, once: none may be a held-out prompt
            heldout.refuse_training_prompts(questions, NewestRows(storage, job))
    except heldout.EvalError as exc:
        raise click.ClickException(str(exc)) from None

    spec = read_spec(checkpoint)
    target_dir = Path(target or spec.target_model)
    if not (target_dir / "config.json").is_file():
        raise click.BadParameter(f"{target_dir} is not a model directory (no config.json)"
                                 + ("" if target else "; the checkpoint names it: pass --target"),
                                 param_hint="--target")
    tokenizer_dir = TrainConfig.model_validate(
        {**reference, "target_model": str(target_dir)}).tokenizer_dir()
    if tokenizer_dir is None:
        raise click.ClickException(f"no tokenizer to render the prompts: {target_dir} holds none")
    try:
        template = ChatTemplate.load(tokenizer_dir)
    except TokenizeError as exc:
        raise click.ClickException(str(exc)) from None
    out = out or checkpoint / heldout.REPORT_FILE
    report = _measure(checkpoint, target_dir, reference.get("dtype", "float32"), device,
                      template, settings, mode, questions, out)
    if run is not None and run.final:  # no worker writes its evals any more
        from dflash_tasks.training.queue import runs

        runs.update(r, run.name, evals=[*(run.get("evals") or []), heldout.summary(report)])
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        _print(report, out)


def _measure(checkpoint: Path, target_dir: Path, dtype: str, device: str, template, settings,
             thinking: bool, questions: list, out: Path) -> dict:
    from dflash_tasks.training.reference import heldout
    from dflash_tasks.training.reference.target import load_target, pick_device
    from dflash_tasks.training.reference.trainer import DTYPES

    try:
        target = load_target(target_dir, dtype=DTYPES[dtype], device=pick_device(device))
        report = heldout.evaluate_checkpoint(checkpoint, target, template, settings, thinking,
                                             prompts=questions, report_path=out)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"{checkpoint}: {exc}") from None
    return report
