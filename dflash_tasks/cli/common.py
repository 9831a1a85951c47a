"""What every command shares: consoles, and Redis and job look-ups that fail with a clear message."""
from __future__ import annotations

import click
import redis
from rich.console import Console

from .. import jobs, lifecycle
from ..settings import get_settings, redact_url

console = Console()
err_console = Console(stderr=True)


def redis_or_fail() -> redis.Redis:
    from ..connections import redis_client

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
    target = allowed_or_fail(command, job)
    if target != job.status and not jobs.transition(r, job.name, job.status, target):
        raise changed_meanwhile(r, job)
    return target


def changed_meanwhile(r: redis.Redis, job: jobs.Job) -> click.ClickException:
    now = jobs.load(r, job.name)
    return click.ClickException(f"job {job.name} changed from {job.status} to "
                                f"{now.status if now else 'deleted'} while this ran; nothing was "
                                "changed: run the command again")
