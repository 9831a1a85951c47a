"""What every command shares: consoles, and Redis and job look-ups that fail with a clear message."""
from __future__ import annotations

import math
from pathlib import Path

import click
import redis
from rich.console import Console

from dflash_tasks.core import jobs, lifecycle
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
    if value is not None and (value == 0 or value < -1):
        raise click.BadParameter(f"{value} is not a valid top-k: -1 (off) or at least 1")
    return value


def generation_options(f):
    """--max-output-tokens, --temperature, --top-p and --top-k with their bounds (help shows them)."""
    for option in reversed([
        click.option("--max-output-tokens", type=click.IntRange(min=1, max=MAX_OUTPUT_TOKENS),
                     help=f"Cap on generated tokens, 1 to {MAX_OUTPUT_TOKENS:,} [8192]."),
        click.option("--temperature", type=FiniteFloatRange(min=0, max=MAX_TEMPERATURE),
                     help=f"Sampling temperature, 0 to {MAX_TEMPERATURE:g} [0.6]."),
        click.option("--top-p", type=FiniteFloatRange(min=0, max=1, min_open=True),
                     help="Nucleus sampling, over 0 up to 1 [0.95]."),
        click.option("--top-k", type=int, callback=_top_k, help="-1 (off) or at least 1 [20]."),
    ]):
        f = option(f)
    return f


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


def job_or_fail(r: redis.Redis, name: str) -> jobs.Job:
    try:
        job = jobs.load(r, name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from None
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

def rule_options(f):
    """The row rules, shared by validate and the training formats of export."""
    f = click.option("--keep-truncated", is_flag=True,
                     help="Keep rows cut by max_tokens (dropped by default: their answer never "
                          "finished).")(f)
    f = click.option("--max-length", type=click.IntRange(min=1), default=16384, show_default=True,
                     help="The training max length: longer rows (input ids) are flagged and "
                          "dropped.")(f)
    f = click.option("--min-loss-tokens", type=click.IntRange(min=0), default=32,
                     show_default=True,
                     help="Rows with fewer loss-mask tokens are flagged and dropped.")(f)
    f = click.option("--tokenizer", type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help="The target model's tokenizer directory (its chat template renders rows "
                          "without server token ids; validate also checks it against the ids).")(f)
    return f


def job_storage_from(source: str | None, name: str):
    """The job's shipped batches: at --from, else the deployment's storage."""
    from dflash_tasks.output.storage import storage_at, storage_for
    from dflash_tasks.training.data.reader import job_storage

    s = get_settings()
    return job_storage(storage_at(source, s) if source else storage_for(s), name)


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


def check_job_option(name: str) -> None:
    """--job refused with the naming rule when it is not a valid job name."""
    from dflash_tasks.core.keys import check_job_name

    try:
        check_job_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from None
