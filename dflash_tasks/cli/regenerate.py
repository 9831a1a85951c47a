"""`regenerate`: run again the prompts whose newest row ended a given way (typically truncated
under an old cap), optionally continuing their output instead of starting over."""
from __future__ import annotations

import json

import click

from dflash_tasks.cli.common import allowed_or_fail, console, job_or_fail, redis_or_fail
from dflash_tasks.core.settings import get_settings

CHUNK = 500


@click.command()
@click.option("--job", "name", required=True)
@click.option("--finish-reason", required=True, help="Rows that ended this way: length, stop, abort...")
@click.option("--continue", "continue_output", is_flag=True,
              help="Continue truncated outputs from their token ids (SGLang /generate) instead of "
                   "starting over: only the missing tokens are generated.")
@click.option("--limit", type=click.IntRange(min=1), help="At most N prompts.")
def regenerate(name: str, finish_reason: str, continue_output: bool, limit: int | None) -> None:
    """Generate again the prompts whose row ended with FINISH_REASON. The new row replaces the
    old one (readers keep the newest row per id); counters and progress.json follow."""
    from dflash_tasks import dispatch
    from dflash_tasks.core import jobs
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.output.batches import iter_newest_rows
    from dflash_tasks.output.storage import StorageError, storage_for
    from dflash_tasks.sglang.continuation import entry_from_row
    from dflash_tasks.tasks.app import app

    r = redis_or_fail()
    job = job_or_fail(r, name)
    allowed_or_fail("regenerate", job)
    cap = job.params.max_tokens
    book = shared_ledger()
    reopened = continued = saved = 0
    batch: list[tuple[dict, dict]] = []

    def flush() -> None:
        nonlocal reopened, continued, saved
        for row, entry in batch:
            kept = len(entry["continue"]["response_ids"]) if "continue" in entry else 0
            if book.reopen(name, row, json.dumps(entry, ensure_ascii=False, separators=(",", ":")),
                           kept):
                reopened += 1
                continued += bool(kept)
                saved += kept
        batch.clear()

    try:
        for row in iter_newest_rows(r, storage_for(get_settings()), name):
            if row["metadata"]["finish_reason"] != finish_reason:
                continue
            if continue_output and finish_reason == "length" and row["metadata"]["completion_tokens"] >= cap:
                raise click.UsageError(
                    f"row {row['id']} already has {row['metadata']['completion_tokens']:,} tokens and "
                    f"the job's max_tokens is {cap:,}: raise it first (manage.py set --job {name} "
                    "--max-output-tokens N), then continue")
            batch.append((row, entry_from_row(row, continue_output=continue_output)))
            if len(batch) >= CHUNK:
                flush()
            if limit and reopened + len(batch) >= limit:
                break
        failure = None
    except StorageError as exc:
        # The rows read so far are queued again (the job runs them like any other); running it
        # again once the storage answers takes the rest: a prompt already taken back is no
        # longer done, so it is not taken twice.
        failure = exc
    flush()
    if reopened:
        from dflash_tasks.training.data.monitor import restart_window

        restart_window(r, name)  # its facts of the rows just superseded would still count
    if reopened and job.status == "done":
        jobs.transition(r, name, "done", "running")  # the lifecycle: a done job with work runs
    if reopened and (now := jobs.load(r, name)).status == "running":
        dispatch.topup_all(app, book, get_settings(), now)
    if failure is not None:
        raise click.ClickException(
            f"{failure}; {reopened:,} prompts were queued again before it: run the same command "
            "again once the storage answers")
    console.print(f"job {name}: {reopened:,} prompts with finish_reason {finish_reason!r} queued "
                  f"again at max_tokens {cap:,}")
    if continue_output:
        console.print(f"  {continued:,} continue from their truncated output: {saved:,} tokens "
                      "reused, not generated again")
        if reopened > continued:
            console.print(f"  {reopened - continued:,} start over (no token ids in the row)")
