"""`manage.py export`: a job's shipped dataset, downloaded and verified as batches, or written
in a training format (the rows that pass the quality gate's rules)."""
from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from dflash_tasks.cli.common import (
    JOB,
    chat_template_option,
    console,
    directory_to_write,
    err_console,
    job_storage_from,
    output_storage,
    rule_options,
    shipped_progress,
    storage_location,
)
from dflash_tasks.core.keys import JobName


def training_options(f):
    """`--format` and the rules its training formats apply."""
    from dflash_tasks.training.data.exports import FORMATS

    f = rule_options(f)
    return click.option("--format", "fmt", type=click.Choice(["batches", *FORMATS]),
                        default="batches", show_default=True,
                        help="batches: the verified zstd batches and manifest as shipped; "
                             "specforge-conversations: SpecForge's regenerated-data JSONL; "
                             "specforge-tokenized: input_ids + loss_mask JSONL for SpecForge's "
                             "prompts_path; parquet: for datasets.load_dataset. The training "
                             "formats keep only rows that pass the quality gate's rules and "
                             "report what was dropped and why.")(f)


@click.command()
@click.option("--job", "name", type=JOB, required=True, help="The job whose dataset to download.")
@click.option("--to", "dest", required=True, callback=directory_to_write, metavar="DIR",
              help="Destination directory (created; batches already there and intact are kept).")
@click.option("--from", "source", metavar="S3_URI_OR_DIR", callback=storage_location,
              help="Where the batches are.", show_default="the location the job keeps")
@click.option("--allow-partial", is_flag=True,
              help="Succeed even when fewer rows are shipped than the job has completed.")
@training_options
def export(name: JobName, dest: Path, source: str | None, allow_partial: bool, **training) -> None:
    """Download a job's batches and manifest, verify every checksum, that no id appears twice,
    and that the row count equals the job's completed count. With --format, write the rows
    that pass the quality gate's rules in a training format instead."""
    if training["fmt"] != "batches":
        return export_format(name, dest, source, **training)
    import redis

    from dflash_tasks.core.connections import redis_client
    from dflash_tasks.output.batches import ChecksumMismatch
    from dflash_tasks.output.export import ExportError, expected_completed
    from dflash_tasks.output.export import export as run_export
    from dflash_tasks.output.storage import StorageError

    r = redis_client()
    try:
        r.ping()
    except redis.exceptions.RedisError:
        r = None  # the training side may have no Redis: progress.json says how many completed
    storage = output_storage(source, name, r)
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
            regenerated = int(r.hget(name.counters, "regenerated") or 0) if r else 0
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


def export_format(name: JobName, dest: Path, source: str | None, *, fmt: str,
                  tokenizer: Path | None, min_loss_tokens: int, max_length: int | None,
                  long_rows: str, keep_truncated: bool, keep_looping: bool) -> None:
    """The training formats of `manage.py export`."""
    from dflash_tasks.output.batches import ChecksumMismatch
    from dflash_tasks.output.storage import StorageError
    from dflash_tasks.training.data.exports import export_training, report_files
    from dflash_tasks.training.data.gate import REASONS, Rules
    from dflash_tasks.training.data.reader import NoManifest

    storage = job_storage_from(source, name)
    template = chat_template_option(tokenizer)
    rules = Rules(min_loss_tokens=min_loss_tokens, max_length=max_length, long_rows=long_rows,
                  keep_truncated=keep_truncated, keep_looping=keep_looping)
    state = shipped_progress(storage, name)
    if state and state.get("status") != "done":
        err_console.print(f"[yellow]job {name} is {state.get('status')}: exporting the rows "
                          "shipped so far[/]")
    try:
        with err_console.status(f"exporting {name} as {fmt} ...") as spin:
            n = [0]

            def on_batch(rec: dict) -> None:
                n[0] += 1
                spin.update(f"read {n[0]} batches ({rec['name']})")

            out = export_training(storage, name, fmt, dest, rules, template=template,
                                  on_batch=on_batch)
    except (NoManifest, ChecksumMismatch, StorageError) as exc:
        raise click.ClickException(str(exc)) from None
    summary = out.summary()
    t = Table(title=f"export of job {name} as {fmt}", show_header=False, box=None)
    t.add_row("manifest", storage.location(f"{name}/manifest.json"))
    t.add_row("to", str(out.path))
    t.add_row("rows read", f"{summary['rows_read']:,} ({summary['unique_ids']:,} unique ids)")
    t.add_row("kept", f"{out.kept:,}")
    for reason, count in sorted(summary["dropped"].items(), key=lambda kv: -kv[1]):
        t.add_row(f"dropped: {reason}", f"{count:,}  ({REASONS[reason]})")
    report_name, dropped_name = report_files(fmt)
    t.add_row("report", str(Path(dest) / report_name) + ", dropped ids in "
              + str(Path(dest) / dropped_name))
    if fmt == "specforge-conversations" and out.kept:
        from dflash_tasks.training.queue.specforge import HandoffError, template_for

        try:
            t.add_row("SpecForge", f"data.chat_template: {template_for(None, dict(out.thinking))}"
                                   ", data.train_only_last_turn: true")
        except HandoffError as exc:
            err_console.print(f"[yellow]{exc}[/]")
        if keep_truncated:
            err_console.print("[yellow]truncated rows kept: SpecForge renders each with an "
                              "end-of-turn token the model never generated, and trains on it[/]")
    console.print(t)
    if out.kept == 0:
        raise click.ClickException(f"no row of job {name} passed the rules: nothing to train on "
                                   f"(see {report_name})")
