"""The shipped dataset: download and verify it (export)."""
from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from dflash_tasks.cli.common import console, err_console
from dflash_tasks.cli.validate import training_options
from dflash_tasks.core.settings import get_settings


@click.command()
@click.option("--job", "name", required=True, help="The job whose dataset to download.")
@click.option("--to", "dest", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Destination directory (created; batches already there and intact are kept).")
@click.option("--from", "source", metavar="S3_URI_OR_DIR",
              help="Where the batches are [DFLASH_S3_URI, else DFLASH_OUTPUT_DIR].")
@click.option("--allow-partial", is_flag=True,
              help="Succeed even when fewer rows are shipped than the job has completed.")
@training_options
def export(name: str, dest: Path, source: str | None, allow_partial: bool, **training) -> None:
    """Download a job's batches and manifest, verify every checksum, that no id appears twice,
    and that the row count equals the job's completed count. With --format, write the rows
    that pass the quality gate's rules in a training format instead."""
    if training["fmt"] != "batches":
        from dflash_tasks.cli.validate import export_format

        return export_format(name, dest, source, **training)
    import redis

    from dflash_tasks.core.connections import redis_client
    from dflash_tasks.core.keys import JobKeys, check_job_name
    from dflash_tasks.output.batches import ChecksumMismatch
    from dflash_tasks.output.export import ExportError, expected_completed
    from dflash_tasks.output.export import export as run_export
    from dflash_tasks.output.storage import StorageError, storage_at, storage_for

    try:
        check_job_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from None
    s = get_settings()
    storage = storage_at(source, s) if source else storage_for(s)
    r = redis_client()
    try:
        r.ping()
    except redis.exceptions.RedisError:
        r = None  # the training side may have no Redis: progress.json says how many completed
    try:
        expected, where, status = expected_completed(storage, name, r)
        if expected is None:
            err_console.print("[yellow]no ledger and no progress.json for this job: the row "
                              "count cannot be checked against completed[/]")
        elif status not in (None, "done"):
            err_console.print(f"[yellow]job {name} is {status}: rows not yet shipped are "
                              "still in Redis[/]")
        with console.status(f"downloading {name} from {storage.location(name)} ...") as spin:
            done = [0]

            def on_batch(rec: dict) -> None:
                done[0] += 1
                spin.update(f"verified {done[0]} batches ({rec['name']})")

            # Regenerated ids have an older row too (the newest wins); the ledger says how many.
            regenerated = int(r.hget(JobKeys(name).counters, "regenerated") or 0) if r else 0
            report = run_export(storage, name, dest, expected=expected, expected_source=where,
                                allow_partial=allow_partial, regenerated=regenerated,
                                on_batch=on_batch)
    except (ExportError, ChecksumMismatch, StorageError) as exc:
        raise click.ClickException(str(exc)) from None

    t = Table(title=f"export of job {name}: verified", show_header=False, box=None)
    t.add_row("from", storage.location(name))
    t.add_row("to", str(dest))
    t.add_row("batches", f"{report.batches:,} ({report.downloaded:,} downloaded, "
                         f"{report.reused:,} already there)")
    t.add_row("rows", f"{report.rows:,} (one per id)" + (
        f"; {report.replaced:,} older rows of regenerated ids, superseded by the newest"
        if report.replaced else ""))
    t.add_row("bytes", f"{report.bytes:,}")
    t.add_row("completed", f"{report.expected:,} per {report.expected_source}"
              if report.expected is not None else "unknown")
    console.print(t)
    for problem in report.problems:
        err_console.print(f"[yellow]{problem}[/]")
