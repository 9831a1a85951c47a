"""Steering a job while it runs: list jobs, pause, resume, cancel, delete, change its parameters.
Each command asks the lifecycle (dflash_tasks.core.lifecycle) whether the job's state allows it."""
from __future__ import annotations

import click
from rich.table import Table

from dflash_tasks.cli.common import (
    JOB,
    allowed_or_fail,
    change_state,
    changed_meanwhile,
    console,
    generation_options,
    job_option,
    job_or_fail,
    params_or_fail,
    redis_or_fail,
    storage_location,
)
from dflash_tasks.core import jobs, lifecycle
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import get_settings


@click.command("jobs")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable: a list of jobs.")
def list_jobs(as_json: bool) -> None:
    """Every job with its status, progress and where its batches go."""
    import json

    from dflash_tasks.ledger import shared_ledger

    r = redis_or_fail()
    listed = []
    for name in jobs.names(r):
        job = jobs.load(r, name)
        if job is None:  # deleted since it was listed
            continue
        c = shared_ledger().counters(name)
        listed.append({"job": name, "status": job.status, "completed": c.get("completed", 0),
                       "total": c.get("total", 0), "failed": c.get("failed", 0),
                       "max_tokens": job.params.max_tokens, "gpus": job.selection.describe(),
                       "output": job.output or get_settings().output_location()})
    if as_json:
        click.echo(json.dumps(listed, indent=1))
        return
    table = Table("job", "status", "done", "total", "failed", "max_tokens", "gpus")
    for j in listed:
        table.add_row(j["job"], j["status"], f"{j['completed']:,}", f"{j['total']:,}",
                      f"{j['failed']:,}", str(j["max_tokens"]), j["gpus"])
    console.print(table)
    # Below the table, one line each: a path in a table column is folded across lines, and
    # one copied from there is not the path.
    for j in listed:
        console.print(f"{j['job']} writes to {j['output']}", soft_wrap=True, highlight=False)


@click.command()
@job_option
def pause(name: JobName) -> None:
    """Stop dispatching the job's prompts; requests in flight finish and are kept."""
    r = redis_or_fail()
    change_state(r, "pause", job_or_fail(r, name))
    console.print(f"job {name}: paused (requests in flight finish; `resume` continues)")


@click.command()
@job_option
def resume(name: JobName) -> None:
    """Dispatch the job's prompts again."""
    from dflash_tasks import dispatch
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.tasks.app import app

    r = redis_or_fail()
    job = job_or_fail(r, name)
    change_state(r, "resume", job)
    book, s = shared_ledger(), get_settings()
    now = jobs.load(r, name)  # None: deleted since (by a command that came after)
    sent = dispatch.topup_all(app, book, s, now) if now is not None else 0
    console.print(f"job {name}: running ({sent} prompts dispatched now)")


@click.command()
@job_option
@click.confirmation_option(prompt="Cancel this job? Nothing more is dispatched (resume can finish it later)")
def cancel(name: JobName) -> None:
    """Stop dispatching the job for good; rows already made are kept, and the prompts never
    generated stay counted (`resume` finishes them, `delete` removes the job)."""
    from dflash_tasks import dispatch
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.output.progress import snapshot

    r = redis_or_fail()
    change_state(r, "cancel", job_or_fail(r, name))
    dispatch.withdraw_cancelled(shared_ledger(), name)
    snap = snapshot(r, name, get_settings())
    running = snap["in_flight"] + snap["retry_waiting"]
    console.print(f"job {name}: cancelled; {snap['remaining']:,} prompts have no row: "
                  f"{snap['pending']:,} never started"
                  + (f", {running:,} already sent finish and are kept" if running else "")
                  + f" (`manage.py resume --job {name}` generates the rest, "
                    f"`manage.py delete --job {name}` removes the job)")


@click.command("set")
@job_option
@generation_options(shown_defaults=False)
def set_params(name: JobName, **options) -> None:
    """Change the job's generation parameters for every prompt not yet started, without
    stopping workers or servers; a generation already started (in rounds, moved, waiting to go
    on) keeps the sampling it started with, and takes the new cap. What is not given keeps the
    job's current value; the thinking mode is fixed when the job is created."""
    from dflash_tasks.core.lifecycle import TRANSITIONS
    from dflash_tasks.ledger import shared_ledger

    r = redis_or_fail()
    job = job_or_fail(r, name)
    allowed_or_fail("set", job)
    old = job.params
    new = params_or_fail(name, old, existing=True, **options)
    get_settings().failpoint("set.before_apply")
    # Compare and set against the parameters read above, so a concurrent command (another set,
    # an enqueue with parameters) is never overwritten; any state set is allowed in will do.
    wrong = shared_ledger().update_job(name, {**job.as_read("params"), "status": TRANSITIONS["set"]},
                                       {"params": new.stored()})
    if wrong:
        raise click.ClickException(f"{changed_meanwhile(name, job.stored, wrong)}; nothing was changed: run "
                                   "the command again")
    shown = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "enable_thinking")
    width = max(map(len, shown))
    for field in shown:
        before, after = getattr(old, field), getattr(new, field)
        mark = "  (changed)" if before != after else ""
        console.print(f"{field:{width}} {before} -> {after}{mark}")


@click.command()
@job_option
@click.confirmation_option(prompt="Remove this job and all its prompts from Redis?")
def delete(name: JobName) -> None:
    """Remove a job (not running) and every Redis key it has, then its prompt bodies kept on
    storage (`enqueue --bodies storage`); batches already shipped stay in the output directory
    or bucket."""
    from dflash_tasks.output.spool import Spool

    r = redis_or_fail()
    job = job_or_fail(r, name)
    allowed_or_fail("delete", job)
    spooled = int(r.hget(job.name.counters, "spooled") or 0)
    # Redis first, compare and delete in one transaction: a resume or enqueue since the job was
    # read keeps it whole, chunks included; once it is gone no command stores chunks for it.
    get_settings().failpoint("delete.before_apply")
    try:
        gone = jobs.delete(r, name, allowed=lifecycle.TRANSITIONS["delete"])
    except (ValueError, jobs.JobDeleted) as exc:
        raise click.ClickException(f"{exc}; nothing was deleted") from None
    console.print(f"job {name}: deleted ({gone.keys} Redis keys); its shipped batches are kept")
    # Batches beat spooled during an S3 outage and never shipped: their rows leave with the job.
    spool = Spool(get_settings().spool_path())
    removed = spool.remove_job(name)
    if removed:
        console.print(f"job {name}: {removed:,} batches removed from the spool {spool.root}")
    elif spooled:
        console.print(f"job {name}: {spooled:,} batches of it were in beat's spool, not on this "
                      f"machine: remove {spool.root / name} on beat's machine")
    if gone.bodies is not None:
        get_settings().failpoint("delete.before_chunks")
        _remove_chunks(name, gone.bodies, gone.chunks_through)


def _remove_chunks(name: JobName, location: str, through: int) -> int:
    """A deleted job's chunks of prompt bodies, removed; a storage that does not answer fails
    the command (exit 1) with where they are and the command that removes them later."""
    from dflash_tasks.ledger.bodies import chunks_prefix, remove_chunks
    from dflash_tasks.output.storage import StorageError, storage_at

    try:
        storage = storage_at(location, get_settings())
        where = storage.location(chunks_prefix(name))
        chunks = remove_chunks(storage, name, through)
    except StorageError as exc:
        raise click.ClickException(
            f"job {name} is deleted, but its prompt chunks under {location} (those numbered "
            f"{through} or lower in {name}/prompts/) could not be removed ({exc}); once the "
            f"storage answers, run {remove_chunks_command(name, location, through)}") from None
    if chunks:
        console.print(f"job {name}: {chunks:,} chunks of prompt bodies removed from {where}")
    return chunks


def remove_chunks_command(name: JobName, location: str, through: int) -> str:
    return f"`manage.py remove-chunks --job {name} --location {location} --through {through}`"


@click.command("remove-chunks")
@click.option("--job", "name", type=JOB, required=True, metavar="NAME",
              help="The deleted job whose chunks are left.")
@click.option("--location", required=True, metavar="DIR_OR_S3_URI", callback=storage_location,
              help="Where its prompt bodies were kept, as `delete` said.")
@click.option("--through", type=click.IntRange(min=0), required=True, metavar="N",
              help="The highest chunk number of the deleted job, as `delete` said.")
def remove_chunks_left(name: JobName, location: str, through: int) -> None:
    """Remove the chunks of prompt bodies a deleted job left on storage (`delete` names them
    when the storage did not answer): those numbered N or lower under the location's
    <job>/prompts/. A later job of the same name numbers its chunks higher and keeps them."""
    if not _remove_chunks(name, location, through):
        raise click.ClickException(f"no chunk of job {name} numbered {through} or lower under "
                                   f"{location}: nothing to remove (is it the job and location "
                                   "`delete` named?)")
