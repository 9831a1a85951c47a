"""Training runs: `train` (queue one), `train-cancel`, `train-status`."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from dflash_tasks.cli.common import JOB, console, err_console, redis_or_fail
from dflash_tasks.core.keys import JobName


def _spec(config: Path | None, trainer: str, template: str | None, command: str | None) -> dict:
    """The run's spec, checked against the templates this machine's DFLASH_TRAIN_TEMPLATES
    defines (the training node's own: it checks the spec again before it runs anything)."""
    from dflash_tasks.core.settings import get_settings
    from dflash_tasks.training.queue.spec import SpecError, build, node_commands, read_config

    try:
        commands = node_commands(get_settings().train_templates)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    if command:
        try:
            template = commands.name_of(command)
        except SpecError as exc:
            raise click.BadParameter(str(exc), param_hint="--command") from None
    try:
        return build(read_config(config), trainer, template, str(config or "--config"),
                     commands)
    except SpecError as exc:
        if config is None and trainer == "reference":
            raise click.UsageError("the reference trainer needs --config FILE: its "
                                   "[reference] section names the target model at least "
                                   f"(docs/TRAINING.md); {exc}") from None
        raise click.BadParameter(str(exc), param_hint="--config" if config or not template
                                 else "--template") from None


def _check_job(r, name: JobName, waits: bool) -> None:
    """A run that waits for its trigger needs a job this deployment runs; one that starts now
    needs shipped batches (in Redis's manifest, or a manifest in storage from elsewhere)."""
    from dflash_tasks.core import jobs
    from dflash_tasks.core.settings import get_settings
    from dflash_tasks.output.batches import manifest_key
    from dflash_tasks.output.storage import StorageError, storage_for

    job = jobs.load(r, name)
    if job is not None:
        return
    if waits:
        raise click.ClickException(f"no job named {name!r} in this deployment: --after-done and "
                                   "--min-rows wait for a job that is generating (known jobs: "
                                   f"{', '.join(jobs.names(r)) or 'none'})")
    storage = storage_for(get_settings())  # a job not in this Redis: the deployment's storage
    try:
        found = storage.exists(manifest_key(name))
    except StorageError as exc:
        raise click.ClickException(str(exc)) from None
    if not found:
        raise click.ClickException(f"no job named {name!r} here and no manifest at "
                                   f"{storage.location(manifest_key(name))}: nothing to train on")


@click.command()
@click.option("--job", "job", type=JOB, required=True, help="The job whose rows to train on.")
@click.option("--after-done", is_flag=True,
              help="Wait for the job to be done; beat launches the run then.")
@click.option("--min-rows", type=click.IntRange(min=1), metavar="N",
              help="Wait until N rows are shipped; the run then follows the job while it "
                   "generates (reference trainer).")
@click.option("--trainer", type=click.Choice(["reference", "command"]), default="reference",
              show_default=True,
              help="reference: dflash_tasks.training.reference (online DFlash in torch); command: an "
                   "external trainer (SpecForge's CLI by default) on an export of the rows.")
@click.option("--template", metavar="NAME",
              help="The command trainer's command line, by name: one the training node defines "
                   "(DFLASH_TRAIN_TEMPLATES, docs/SECURITY.md), or the built-in specforge: "
                   "`specforge train --config {config_path}`.")
@click.option("--command", "command", metavar="COMMAND_LINE",
              help="The command line itself: accepted only when it is one of those templates "
                   "(the run then names it).")
@click.option("--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML or JSON with the sections [rules] (which rows), [gate] (validate's "
                   "limits), [reference] (the reference trainer), [smoke] (its overfit gate), "
                   "[eval] (tau on held-out prompts) and [command] (the external trainer's run): "
                   "docs/TRAINING.md.")
@click.option("--name", "run_name", help="The run's name.", show_default="JOB-train-N")
@click.option("--smoke", is_flag=True,
              help="Queue nothing: run the overfit gate here, now, on a few of the job's "
                   "shipped rows ([smoke] of --config, or its defaults); exit 1 if it fails.")
@click.option("--json", "as_json", is_flag=True, help="Print the new run as JSON.")
def train(job: JobName, after_done: bool, min_rows: int | None, trainer: str, template: str | None,
          command: str | None, config: Path | None, run_name: str | None, smoke: bool,
          as_json: bool) -> None:
    """Queue a training run of the job's rows for a training worker (manage.py worker --queue
    train). The quality gate (validate) runs first and refuses the run when the data fails it.
    Without --after-done or --min-rows it is queued now, on the rows shipped so far."""
    from dflash_tasks.tasks.train import send
    from dflash_tasks.training.queue import runs

    if smoke:
        if trainer != "reference" or after_done or min_rows or run_name:
            raise click.UsageError("--smoke runs the reference trainer's overfit gate now: "
                                   "not with --trainer command, --after-done, --min-rows or "
                                   "--name")
        _smoke_now(job, _spec(config, trainer, None, None), as_json)
        return
    if after_done and min_rows:
        raise click.UsageError("--after-done and --min-rows are exclusive")
    if (template or command) and trainer != "command":
        raise click.UsageError("--template and --command need --trainer command")
    if template and command:
        raise click.UsageError("--template and --command are exclusive")
    trigger = "after-done" if after_done else "min-rows" if min_rows else "now"
    r = redis_or_fail()
    _check_job(r, job, waits=trigger != "now")
    spec = _spec(config, trainer, template, command)
    try:
        run = runs.create(r, job, trainer, spec, trigger=trigger, min_rows=min_rows or 0,
                          name=run_name)
    except (runs.RunExists, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if trigger == "now":
        send(run.name)
    alone = _no_training_worker() if trigger == "now" else None
    if as_json:
        click.echo(json.dumps({**run.as_dict(), **({"waits": alone} if alone else {})}, indent=1))
        return
    # Only the message of this trigger is formatted: min_rows is None for the other two.
    if trigger == "now":
        when = "queued for the training workers"
    elif trigger == "after-done":
        when = f"waiting for job {job} to be done; beat queues it then"
    else:
        when = f"waiting for {min_rows:,} shipped rows of job {job}; beat queues it then"
    console.print(f"training run [bold]{run.name}[/] ({trainer} trainer): {when}.\n"
                  f"  a training worker runs it: `manage.py worker --queue train`\n"
                  f"  follow it: `manage.py train-status --run {run.name}`", highlight=False)
    if alone:
        err_console.print(f"[yellow]{alone}[/]", highlight=False)


def _no_training_worker() -> str | None:
    """What a queued run waits for when no training worker answers Celery's ping, else None."""
    from dflash_tasks.tasks.train import training_workers

    if training_workers():
        return None
    return ("no training worker answers: the run waits in the train queue until one starts "
            "(`manage.py worker --queue train`, on a GPU node)")


def _smoke_now(job: JobName, spec: dict, as_json: bool) -> None:
    """The overfit gate on the job's rows where they are shipped, in a scratch directory."""
    import tempfile

    from dflash_tasks.cli.common import output_storage
    from dflash_tasks.training.data.reader import NoManifest
    from dflash_tasks.training.reference.config import SmokeConfig, TrainConfig
    from dflash_tasks.training.reference.smoke import SmokeFailed, failure_message, smoke_gate

    def say(line: str) -> None:
        if not as_json:
            console.print(line, highlight=False, markup=False)

    config = TrainConfig.model_validate(spec["reference"])
    target = Path(config.target_model).expanduser()
    if config.target_model.startswith(("/", ".", "~")) and not target.is_dir():
        # a path, not a hub id: transformers would take it for a repo id and say so in a traceback
        raise click.BadParameter(f"[reference] target_model = {config.target_model}: no such "
                                 "directory on this machine (the smoke gate runs here)",
                                 param_hint="--config")
    with tempfile.TemporaryDirectory(prefix="dflash-smoke-") as work:
        try:
            verdict = smoke_gate(config, SmokeConfig.model_validate(spec.get("smoke") or {}),
                                 job=job, source=output_storage(None, job), work_dir=work, log=say)
        except (SmokeFailed, NoManifest) as exc:
            raise click.ClickException(f"smoke gate: {exc}") from None
        except OSError as exc:  # a model or tokenizer that cannot be read (transformers' words)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise click.ClickException(f"smoke gate: {config.target_model}: {first}") from None
    if as_json:
        click.echo(json.dumps(verdict, indent=1))
    if not verdict["passed"]:
        raise click.ClickException(failure_message(verdict))


@click.command("train-cancel")
@click.option("--run", "run_name", help="The run to cancel.")
@click.option("--job", type=JOB, help="Cancel every unfinished run of this job.")
def train_cancel(run_name: str | None, job: JobName | None) -> None:
    """Cancel a training run: at once when it has not started, else its worker stops the
    trainer (a checkpoint is kept) and marks it cancelled."""
    from dflash_tasks.training.queue import runs

    if (run_name is None) == (job is None):
        raise click.UsageError("pass --run NAME or --job NAME")
    r = redis_or_fail()
    if run_name:
        targets = [run_name]
    else:
        targets = [n for n in runs.names(r) if (run := runs.load(r, n)) and run.job == job
                   and not run.final]
        if not targets:
            console.print(f"job {job}: no unfinished training run")
    for name in targets:
        try:
            what = runs.request_cancel(r, name)
        except KeyError:
            raise click.ClickException(f"no training run named {name!r} "
                                       "(`manage.py train-status` lists them)") from None
        if what == "cancelled":
            console.print(f"training run {name}: cancelled (it had not started)")
        elif what == "stopping":
            console.print(f"training run {name}: cancel requested: its worker stops the trainer "
                          "within seconds (train-status shows it cancelled then)")
        else:
            console.print(f"training run {name}: already {runs.load(r, name).status}: nothing "
                          "to cancel")


def _ago(t: float | str | None) -> str:
    if not t:
        return "-"
    s = time.time() - float(t)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _fmt(v, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


@click.command("train-status")
@click.option("--run", "run_name", help="One run in detail: metrics, gate, checkpoints, log.")
@click.option("--job", type=JOB, help="Only this job's runs.")
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
def train_status(run_name: str | None, job: JobName | None, as_json: bool) -> None:
    """Training runs: status, step, loss, per-position accuracy, tokens/s, exit code, duration,
    checkpoints."""
    from dflash_tasks.training.queue import runs

    r = redis_or_fail()
    if run_name:
        run = runs.load(r, run_name)
        if run is None:
            raise click.ClickException(f"no training run named {run_name!r} "
                                       "(`manage.py train-status` lists them)")
        selected = [run]
    else:
        selected = [run for n in runs.names(r) if (run := runs.load(r, n))
                    and (job is None or run.job == job)]
    # A queued run with no training worker alive waits without a word of its own: say so.
    alone = _no_training_worker() if any(run.status == runs.QUEUED for run in selected) else None
    if as_json:
        out = [{**run.as_dict(), **({"waits": alone} if alone and run.status == runs.QUEUED
                                    else {})} for run in selected]
        click.echo(json.dumps(out[0] if run_name else out, indent=1))
        return
    if run_name:
        _detail(selected[0], alone)
        return
    if not selected:
        console.print("no training runs" + (f" for job {job}" if job else ""))
        return
    rows = []
    for run in selected:
        m = run.get("metrics") or {}
        by_pos = m.get("accuracy_by_position") or [None]
        status = run.status + (f" ({run.get('phase')})" if run.status == runs.RUNNING
                               and run.get("phase") else "")
        evals = run.get("evals") or []
        tau = "-" if not evals else "error" if "error" in evals[-1] else \
            _fmt(evals[-1].get("tau"), ".2f")
        rows.append({"run": run.name, "job": run.job, "trainer": run.trainer, "status": status,
                     "tau": tau,
                     "step": _fmt(m.get("step")), "loss": _fmt(m.get("loss"), ".4f"),
                     "acc@1": _fmt(by_pos[0], ".3f"), "tokens/s": _fmt(m.get("tokens_per_s"), ",.0f"),
                     "exit": _fmt(run.get("exit_code")), "duration (s)": _fmt(run.get("duration_s"), ".0f"),
                     "checkpoints": str(len(run.get("checkpoints") or [])),
                     "updated": _ago(run.get("finished_at") or run.get("started_at")
                                     or run.get("created_at"))})
    t = Table()
    shown = _columns_that_fit(rows, console.width)
    for col in shown:
        t.add_column(col, overflow="fold")
    for row in rows:
        t.add_row(*(row[col] for col in shown))
    console.print(t)
    if alone:
        err_console.print(f"[yellow]queued: {alone}[/]", highlight=False)
    if len(shown) < len(COLUMNS):
        console.print(f"(not shown at {console.width} columns: "
                      f"{', '.join(c for c in COLUMNS if c not in shown)}; "
                      "train-status --run RUN or --json has everything)", highlight=False)


# The list's columns, most important first: at a terminal's width the first ones that fit are
# shown (a run's every field: --run RUN, or --json), rather than every cell cut to "qwe...".
COLUMNS = ("run", "status", "step", "loss", "tau", "acc@1", "updated", "tokens/s", "exit",
           "checkpoints", "job", "trainer", "duration (s)")
ALWAYS = 4  # run, status, step, loss: shown even when they do not fit (cells then wrap)


def _columns_that_fit(rows: list[dict], width: int) -> list[str]:
    """The columns, in COLUMNS order, whose natural widths fit in `width` (rich's default box:
    a border before each column and after the last, one space of padding each side)."""
    shown, used = [], 1
    for i, col in enumerate(COLUMNS):
        need = max([len(col), *(len(row[col]) for row in rows)]) + 3
        if i < ALWAYS or used + need <= width:
            shown.append(col)
            used += need
    return shown


def _detail(run, alone: str | None = None) -> None:
    t = Table(title=f"training run {run.name}", show_header=False, box=None)
    t.add_column("what", no_wrap=True)
    t.add_column("value", overflow="fold")  # paths and the command wrap, never cut
    t.add_row("job", run.job)
    t.add_row("trainer", run.trainer)
    trigger = run.trigger + (f" ({run.min_rows:,} rows)" if run.trigger == "min-rows" else "")
    t.add_row("status", run.status + (f", phase {run.get('phase')}" if run.get("phase") else "")
              + f"; launched {trigger}")
    if alone and run.status == "queued":
        t.add_row("waits", f"[yellow]{alone}[/]")
    t.add_row("created / started / finished", " / ".join(
        _ago(run.get(k)) for k in ("created_at", "started_at", "finished_at")))
    if run.get("worker"):
        t.add_row("worker", f"{run.get('worker')} (last heartbeat {_ago(run.get('heartbeat_at'))}; attempts "
                            f"{run.get('attempts')}, restarts {run.get('restarts')})")
    for k in ("exit_code", "duration_s", "error", "restart_reason", "run_dir", "log_path"):
        if run.get(k) not in (None, ""):
            t.add_row(k.replace("_", " "), str(run.get(k)))
    if run.trainer == "command" and run.spec.get("command"):
        t.add_row("template", str(run.spec["command"]["template"]))
    gate = run.get("gate")
    if gate:
        t.add_row("quality gate", ("passed" if gate["passed"] else "FAILED") +
                  f": {gate.get('rows', 0):,} rows, {gate.get('kept') or 0:,} kept")
        for f in gate.get("failures", []):
            t.add_row("", f"- {f}")
    smoke = run.get("smoke")
    if smoke:
        t.add_row("smoke gate", ("passed" if smoke["passed"] else "FAILED") + (
            f": tau {smoke['tau']:.2f} (needs {smoke['min_tau']:g}) on {smoke['rows']} row(s) "
            f"after {smoke['steps']} steps" if "tau" in smoke else f": {smoke.get('error')}"))
    for e in run.get("evals") or []:
        name = Path(e["checkpoint"]).name
        t.add_row("eval " + name, Text(f"error: {e['error']}", style="red") if "error" in e else
                  f"tau {e['tau']:.2f} of {e['block_size']} (pooled "
                  f"{_fmt(e.get('tau_pooled'), '.2f')}) over {e['prompts']} held-out "
                  f"prompts (T={e['temperature']:g}); by position " + " ".join(
                      f"{a:.2f}" for a in e["acceptance_by_position"] if a is not None))
    m = run.get("metrics")
    if m:
        t.add_row("step", f"{m.get('step')} (epoch {m.get('epoch')}, {m.get('samples')} samples)")
        t.add_row("loss / accuracy", f"{_fmt(m.get('loss'), '.4f')} / {_fmt(m.get('accuracy'), '.3f')}")
        t.add_row("accuracy by position", "  ".join(
            f"{k}:{a:.2f}" for k, a in enumerate(m.get("accuracy_by_position") or [], start=1)))
        t.add_row("tokens/s", _fmt(m.get("tokens_per_s"), ",.0f"))
    for c in run.get("checkpoints") or []:
        t.add_row("checkpoint", f"{c['name']}: {c.get('uri') or c.get('path')}")
    console.print(t)
    tail = run.get("log_tail") or []
    if tail:
        console.print(f"[bold]log[/] (last {min(len(tail), 20)} lines of "
                      f"{run.get('log_path') or 'train.log'}):")
        for line in tail[-20:]:
            console.print("  " + line, highlight=False, markup=False)
