"""What every command shares: consoles, and Redis and job look-ups that fail with a clear message."""
from __future__ import annotations

import math
import os
from pathlib import Path

import click
import redis
from rich.console import Console

from dflash_tasks.core import jobs, lifecycle
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import get_settings, redact_url

console = Console()
err_console = Console(stderr=True)

# Bounds of the generation parameters, checked when a job is enqueued or changed, so a typo is
# refused with the option and its range instead of failing every prompt at the servers.
# 131,072 is the longest context of a Qwen3 model (32,768 native, x4 with YaRN): no request can
# generate more. Temperature: the OpenAI API's range, which SGLang serves; Qwen3's thinking mode
# samples at 0.6. top_k: -1 turns it off, otherwise at least 1 (SGLang refuses 0).
MAX_OUTPUT_TOKENS = 131_072
MAX_TEMPERATURE = 2.0


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange lets nan through (every comparison with it is false)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number in the range {self._describe_range()}",
                      param, ctx)
        return number


def _top_k(ctx, param, value):
    value = _given(ctx, param, value)
    if value is not None and (value == 0 or value < -1):
        raise click.BadParameter(f"{value} is not a valid top-k: -1 (off) or at least 1")
    return value


def _given(ctx, param, value):
    """None unless given on the command line: help shows a new job's default, and a resumed
    job keeps its own value of what is not given."""
    from click.core import ParameterSource

    return None if ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT else value


def generation_options(shown_defaults: bool):
    """--max-output-tokens, --temperature, --top-p, --top-k, --min-p, --repetition-penalty and
    --thinking with their bounds. A new job's
    defaults are shown as click shows any default; `set` (shown_defaults False) keeps the job's
    current value of what it is not given, so it shows none. Each option's value is None when it
    is not given (_given)."""
    from dflash_tasks.core.jobs import GenerationParams

    new = GenerationParams()

    def shown(value):
        return {"default": value, "show_default": True} if shown_defaults else {}

    def decorate(f):
        for option in reversed([
            click.option("--max-output-tokens", type=click.IntRange(min=1, max=MAX_OUTPUT_TOKENS),
                         callback=_given, help="Cap on generated tokens.", **shown(new.max_tokens)),
            click.option("--temperature", type=FiniteFloatRange(min=0, max=MAX_TEMPERATURE),
                         callback=_given, help="Sampling temperature.", **shown(new.temperature)),
            click.option("--top-p", type=FiniteFloatRange(min=0, max=1, min_open=True),
                         callback=_given, help="Nucleus sampling.", **shown(new.top_p)),
            click.option("--top-k", type=int, callback=_top_k,
                         help="Top-k sampling: -1 (off) or at least 1.", **shown(new.top_k)),
            click.option("--min-p", type=FiniteFloatRange(min=0, max=1), callback=_given,
                         help="Min-p sampling (0: off).", **shown(new.min_p)),
            click.option("--repetition-penalty", type=FiniteFloatRange(min=0, max=2, min_open=True),
                         callback=_given, help="Repetition penalty (1: off). A penalised "
                         "generation runs in one request: it is never cut into rounds or moved.",
                         **shown(new.repetition_penalty)),
            click.option("--thinking/--no-thinking", callback=_given,
                         help="Qwen3's thinking mode, fixed when the job is created.",
                         **(shown(new.enable_thinking) if shown_defaults else {"default": None})),
        ]):
            f = option(f)
        return f
    return decorate


def params_or_fail(name, base, *, existing: bool, max_output_tokens=None, temperature=None,
                   top_p=None, top_k=None, min_p=None, repetition_penalty=None, thinking=None):
    """`base` with the generation options given (None: not given). A job's thinking mode is fixed
    when it is created: its rows would otherwise mix two modes, which the training gate refuses
    (training/data/thinking.py), and a generation already started was rendered in the old one."""
    if existing and thinking is not None and thinking != base.enable_thinking:
        mode = "on" if base.enable_thinking else "off"
        raise click.UsageError(
            f"job {name} was created with thinking {mode}; a job's thinking mode is fixed when it "
            "is created (its rows would mix two modes, which training refuses): enqueue the "
            "dataset as a new job instead")
    try:
        return base.replace(max_tokens=max_output_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                            enable_thinking=thinking)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def storage_location(ctx, param, value):
    """A click callback for an option naming a storage location (--output, --from): an
    s3://bucket/prefix URI or a local path that cannot be mistaken for one (settings.py's
    check_location), checked before any work."""
    if value is None:
        return None
    from dflash_tasks.core.settings import check_location

    try:
        return check_location(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def directory_to_write(ctx, param, value):
    """A click callback for an option naming a directory the command creates or fills (export
    --to): checked before any work, so a path under a file or a directory this user cannot write
    is said at once, with nothing done."""
    if value is None:
        return None
    from dflash_tasks.output.storage import directory_problem

    path = Path(value).expanduser().resolve()
    if problem := directory_problem(path):
        raise click.BadParameter(f"{value}: {problem}")
    return path


def file_to_write(suffix: str):
    """A click callback for an option naming a file the command writes (`suffix`, e.g. ".png"):
    checked before any work, so a typo in the path costs nothing and leaves nothing behind."""

    def check(ctx, param, value):
        if value is None:
            return None
        path = Path(value).expanduser()
        if path.suffix.lower() != suffix:
            raise click.BadParameter(f"{value}: the file is written as {suffix}; name it *{suffix}")
        if path.is_dir():
            raise click.BadParameter(f"{value} is a directory; name a file in it")
        folder = path.parent.resolve()
        if not folder.is_dir():
            raise click.BadParameter(f"{value}: the directory {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise click.BadParameter(f"{value}: not writable by this user")
        return path
    return check


class JobNameType(click.ParamType):
    """A --job given on the command line: the one place a command's job name is checked."""

    name = "name"

    def convert(self, value, param, ctx) -> JobName:
        try:
            return JobName(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


JOB = JobNameType()
job_option = click.option("--job", "name", type=JOB, required=True, metavar="NAME",
                          help="The job (manage.py jobs lists them).")


def redis_or_fail() -> redis.Redis:
    from dflash_tasks.core.connections import redis_client

    r = redis_client()
    try:
        r.ping()
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(
            f"cannot reach Redis at {redact_url(get_settings().redis_url)} ({exc}); "
            "set DFLASH_REDIS_URL or start redis-server") from None
    return r


def job_or_fail(r: redis.Redis, name: JobName) -> jobs.Job:
    job = jobs.load(r, name)
    if job is None:
        known = ", ".join(jobs.names(r)) or "none"
        raise click.ClickException(f"no job named {name!r} (known jobs: {known})")
    return job


def allowed_or_fail(command: str, job: jobs.Job) -> str:
    """The state `command` leaves the job in; a refusal (exit 1) names the state and what to run
    instead, and nothing has changed."""
    try:
        return lifecycle.check(command, job.name, job.status)
    except lifecycle.LifecycleError as exc:
        raise click.ClickException(str(exc)) from None


def change_state(r: redis.Redis, command: str, job: jobs.Job) -> str:
    """Check `command` against the job's state and move the job to the state it leads to, unless
    the state changed since it was read (beat finishing it, another command): then refuse, and
    nothing has changed. Returns the new state."""
    from dflash_tasks.ledger import shared_ledger

    target = allowed_or_fail(command, job)
    get_settings().failpoint("state.before_apply")
    if target != job.status and not shared_ledger().transition(job.name, job.status, target):
        now = jobs.load(r, job.name)
        raise click.ClickException(f"job {job.name} changed from {job.status} to "
                                   f"{now.status if now else 'deleted'} while this ran; nothing "
                                   "was changed: run the command again")
    return target


def changed_meanwhile(name: str, read: dict[str, str], wrong: dict[str, str]) -> str:
    """What a compare-and-set (Ledger.update_job) found changed since the command read the job's
    config (`read`), for the loser's message."""
    if not wrong.get("status", "x"):
        return f"job {name} was deleted while this ran"
    parts = [f"{field} from {read.get(field) or '(none)'} to {now or '(none)'}"
             for field, now in sorted(wrong.items())]
    return f"job {name} changed while this ran ({'; '.join(parts)})"


# -- the shipped rows: the row rules and look-ups of validate and export --format ----------------

def rule_options(f=None, *, from_config: bool = False):
    """The row rules, shared by validate and the training formats of export. `from_config`:
    unset, a rule is the training config's (validate applies the gate `train` does)."""
    if f is None:
        return lambda g: rule_options(g, from_config=from_config)

    def default(value, rule: str):
        return ({"default": None, "show_default": f"[rules] {rule}, else the trainer's"}
                if from_config else {"default": value, "show_default": True})
    f = click.option("--keep-truncated/--drop-truncated" if from_config else "--keep-truncated",
                     default=None if from_config else False, is_flag=True,
                     help="Keep rows cut by max_tokens (dropped by default: their answer never "
                          "finished)." + (" [default: [rules] keep_truncated, else the trainer's]"
                                          if from_config else ""))(f)
    f = click.option("--keep-looping/--drop-looping" if from_config else "--keep-looping",
                     default=None if from_config else False, is_flag=True,
                     help="Keep rows whose output ends in a repetition loop (dropped by default: "
                          "a drafter trained on them learns the loop)."
                          + (" [default: [rules] keep_looping, else the trainer's]"
                             if from_config else ""))(f)
    f = click.option("--max-length", type=click.IntRange(min=2),
                     **({"default": None, "show_default": "[rules] max_length, else none"}
                        if from_config else {"default": None, "show_default": "none"}),
                     help="The training max length: longer rows (input ids) are flagged, and "
                          "cut or dropped (--long-rows). None: every row whole.")(f)
    f = click.option("--long-rows", type=click.Choice(["cut", "drop"]), **default("cut", "long_rows"),
                     help="A row longer than --max-length: cut, trained on its first max-length "
                          "tokens (as SpecForge does), or drop.")(f)
    f = click.option("--min-loss-tokens", type=click.IntRange(min=0), **default(32, "min_loss_tokens"),
                     help="Rows with fewer loss-mask tokens are flagged and dropped.")(f)
    f = click.option("--tokenizer", type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help="The target model's tokenizer directory (its chat template renders rows "
                          "without server token ids; validate also checks it against the ids).")(f)
    return f


def output_storage(source: str | None, name: JobName, r: redis.Redis | None = None):
    """Where the job's batches are: --from when given; else the location the job keeps, from
    any directory (when Redis answers: `r`, or the deployment's); else, for a reader without
    Redis (a trainer's machine), the deployment's storage."""
    from dflash_tasks.core.connections import redis_client
    from dflash_tasks.output.storage import job_output, storage_at, storage_for

    s = get_settings()
    if source:
        return storage_at(source, s)
    if r is None:
        try:
            r = redis_client()
            r.ping()
        except redis.exceptions.RedisError:
            return storage_for(s)
    job = jobs.load(r, name)
    return job_output(job, s) if job is not None else storage_for(s)


def job_storage_from(source: str | None, name: JobName):
    """The job's shipped batches (output_storage), read through the job's manifest."""
    from dflash_tasks.training.data.reader import job_storage

    return job_storage(output_storage(source, name), name)


def chat_template_option(path: Path | None):
    """--tokenizer's chat template, or a clear error naming the option."""
    if path is None:
        return None
    from dflash_tasks.training.data.tokens import ChatTemplate, TokenizeError

    try:
        return ChatTemplate.load(path)
    except (TokenizeError, OSError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--tokenizer") from None


def shipped_progress(storage, name: str) -> dict | None:
    """The progress.json beside the job's batches (None when there is none, or unreadable)."""
    from dflash_tasks.output.progress import read_progress
    from dflash_tasks.output.storage import StorageError

    try:
        return read_progress(storage, name)
    except StorageError:
        return None

