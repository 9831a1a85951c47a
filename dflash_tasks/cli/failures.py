"""Failures: `failed` (the registry, grouped by reason) and `retry-failed` (put prompts back)."""
from __future__ import annotations

import datetime as dt
import json

import click
from rich.padding import Padding
from rich.text import Text

from dflash_tasks.cli.common import (
    allowed_or_fail,
    console,
    err_console,
    job_option,
    job_or_fail,
    redis_or_fail,
)
from dflash_tasks.core.keys import JobName

_REASON_HELP = ("A reason (invalid_request, model_not_found, empty_response, internal_error, "
                "prompt_body_corrupt, unavailable, timeout, bad_response, aborted) or a class "
                "(transient, permanent).")


ERROR_CHARS = 1000  # of one error in the listing; --json gives every error whole


def _print_group(reason: str, group: dict, limit: int) -> None:
    """One reason: a line per prompt, its error below it, wrapped at the terminal's width and
    indented (a table's error column is a word or two wide in 80 columns). An error the same as
    the prompt's above it is not printed again."""
    console.print(Text.assemble((f"{reason}", "bold"), f" ({group['class']}): {group['count']:,} "
                                "prompts, " + ", ".join(f"{g} {n:,}" for g, n in group["gpus"].items())))
    previous = None
    for rec in group["prompts"][:limit]:
        console.print(Padding(Text(f"{rec.get('id')}  {rec.get('gpu')}  attempts "
                                   f"{rec.get('attempts', '')}  failed {rec.get('failures', 1)}x  "
                                   f"{_when(rec.get('at'))}", overflow="fold"), (0, 0, 0, 2)))
        error = rec.get("error") or ""
        if error == previous:
            text = Text("(the same error)", style="dim")
        elif len(error) > ERROR_CHARS:
            text = Text(error[:ERROR_CHARS] + f"... ({len(error) - ERROR_CHARS:,} more characters: "
                        "--json)", overflow="fold")
        else:
            text = Text(error or "-", overflow="fold")
        previous = error
        console.print(Padding(text, (0, 0, 0, 6)))
    if group["count"] > limit:
        console.print(f"  ... and {group['count'] - limit:,} more (--limit, or --json)")


def _when(ts) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


@click.command()
@job_option
@click.option("--json", "as_json", is_flag=True, help="Everything, machine-readable.")
@click.option("--limit", type=click.IntRange(min=0), default=10, show_default=True,
              help="Prompts listed per reason (the JSON lists all).")
def failed(name: JobName, as_json: bool, limit: int) -> None:
    """A job's failed registry, grouped by reason, with the retry counters and each GPU
    worker's circuit breaker."""
    from dflash_tasks.dispatch.failures import summary
    from dflash_tasks.ledger import shared_ledger

    r = redis_or_fail()
    job_or_fail(r, name)
    data = summary(shared_ledger(), name)
    if as_json:
        click.echo(json.dumps(data, indent=1, ensure_ascii=False))
        return
    by_class = ", ".join(f"{k} {v:,}" for k, v in sorted(data["by_class"].items())) or "none"
    console.print(f"[bold]job {name}[/]: {data['failed']:,} failed ({by_class}); "
                  f"{data['retries']:,} transient retries so far"
                  + (" (" + ", ".join(f"{k} {v:,}" for k, v in sorted(data["retries_by_reason"].items()))
                     + ")" if data["retries_by_reason"] else "")
                  + (f"; {data['requeued']:,} re-queued by retry-failed" if data["requeued"] else ""))
    for reason, group in data["reasons"].items():
        _print_group(reason, group, limit)
    for gpu, b in data["breakers"].items():
        state = b.get("state", "?")
        style = "red" if state == "open" else "green"
        extra = (f" since {_when(b.get('opened_at'))}, last error: {b.get('last_error')}"
                 if state == "open" else f" (opened {b.get('times_opened', 0)} times)")
        console.print(f"{gpu} circuit breaker: [{style}]{state}[/]{extra}")
    if data["failed"]:
        permanent = data["by_class"].get("permanent", 0)
        console.print(f"Put them back with: `manage.py retry-failed --job {name}` (--reason "
                      "REASON or --gpu GPU: only those"
                      + (f"; --include-permanent: the {permanent:,} permanent ones too, once "
                         "what failed them is mended)" if permanent else ")"))


def _check_reason_and_gpu(r, name: JobName, reason: str | None, gpu: str | None) -> None:
    """A --reason or --gpu that can match nothing is a typo: refused with the choices (the
    reasons the server's answers have, the classes, and those in this job's registry: a task's
    own, such as internal_error or prompt_body_corrupt)."""
    from dflash_tasks import dispatch
    from dflash_tasks.core.keys import GpuName
    from dflash_tasks.dispatch.failures import CLASSES, read
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.sglang import REASONS

    if reason is not None:
        known = dict.fromkeys((*REASONS, *CLASSES, *sorted(
            rec.get("reason", "unknown") for _, _, rec in read(shared_ledger(), name))))
        if reason not in known:
            raise click.BadParameter(f"{reason!r} is not a failure reason: one of "
                                     f"{', '.join(known)}", param_hint="--reason")
    if gpu is not None:
        ran_on = dispatch.dispatched_gpus(r, name)
        if gpu not in ran_on:
            what = f"is not a GPU job {name} ran on" if GpuName.among([gpu]) else \
                "is not a GPU name (gpuI@node)"
            raise click.BadParameter(f"{gpu!r} {what}; its GPUs: {', '.join(ran_on) or 'none yet'}",
                                     param_hint="--gpu")


@click.command("retry-failed")
@job_option
@click.option("--reason", help=_REASON_HELP, show_default="all")
@click.option("--gpu", metavar="GPU", help="Only prompts that failed on this GPU (gpu0@node-a).",
              show_default="all")
@click.option("--include-permanent", is_flag=True,
              help="Also the prompts' own permanent failures (too long for the context, "
                   "malformed), skipped otherwise: unchanged they fail the same way. A --reason "
                   "that names them includes them too.")
@click.option("--dry-run", is_flag=True, help="Only say what would be re-queued.")
@click.option("--json", "as_json", is_flag=True, help="The report, machine-readable.")
def retry_failed(name: JobName, reason: str | None, gpu: str | None, include_permanent: bool,
                 dry_run: bool, as_json: bool) -> None:
    """Dispatch failed prompts again: by default those that can succeed now (a timeout, a server
    that was down). Each leaves the registry in the same atomic step that puts it back in the
    job's dispatch list, so running this twice never sends a prompt twice."""
    from dflash_tasks.core.settings import get_settings
    from dflash_tasks.dispatch.failures import retry_failed as run
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.tasks.app import app

    r = redis_or_fail()
    job = job_or_fail(r, name)
    allowed_or_fail("retry-failed", job)
    _check_reason_and_gpu(r, name, reason, gpu)
    report = run(app, shared_ledger(), get_settings(), name, reason=reason, gpu=gpu,
                 dry_run=dry_run, include_permanent=include_permanent)
    if as_json:
        click.echo(json.dumps({"job": name, "dry_run": dry_run, **report.as_dict()}))
        return
    verb = "would re-queue" if dry_run else "re-queued"
    detail = ", ".join(f"{k} {v:,}" for k, v in sorted(report.by_reason.items()))
    console.print(f"job {name}: {verb} {report.requeued:,} prompts" + (f" ({detail})" if detail else ""))
    if report.skipped_permanent:
        skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(report.skipped_permanent.items()))
        console.print(f"skipped {sum(report.skipped_permanent.values()):,} permanent failures of "
                      f"the prompts themselves ({skipped}): sent again unchanged they fail the "
                      "same way. After a change that mends them (`set --max-output-tokens` lower "
                      "for prompts too long for the context), add --include-permanent")
    if report.missing:
        err_console.print(f"[yellow]{report.missing:,} left in the registry: their prompt text is "
                          "no longer stored (enqueue the dataset again to restore it)[/]")
    if report.skipped_changed:
        err_console.print(f"{report.skipped_changed:,} changed while this ran (another retry-failed, "
                          "or they just failed again); run it again to include them")
    if report.requeued and not dry_run and report.status != "running":
        err_console.print(f"[yellow]job {name} is {report.status}: they are queued and will be "
                          "dispatched when it runs again[/]")
    elif report.requeued and not dry_run:
        console.print(f"GPU windows topped up ({report.dispatched:,} tasks sent); the rest go as "
                      f"slots free up (watch: `manage.py status --job {job.name}`)")
