"""Running a job: enqueue (and resume) it, and watch its status."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import click
from rich.live import Live
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_tasks.cli.common import (
    JOB,
    allowed_or_fail,
    changed_meanwhile,
    console,
    err_console,
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

# -- enqueue ------------------------------------------------------------------------------------

@click.command()
@click.option("--dataset", required=True, metavar="FILE|DIR|hf:ORG/NAME",
              help="JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet file of prompts; or a dataset "
                   "by name: hf:ORG/NAME streamed from the Hugging Face hub, or a local copy of "
                   "one (a save_to_disk directory, or the hub's own layout).")
@click.option("--subset", help="The named dataset's subset (its configuration).")
@click.option("--split", help="The named dataset's split.", show_default="train")
@click.option("--job", "name", type=JOB, required=True,
              help="Job name; enqueue the same job again to resume.")
@generation_options(shown_defaults=True)
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N valid prompts.")
@click.option("--samples", type=click.IntRange(1, 1000),
              help="Rows per prompt: N independent samples, each with its own id (<id>#0 .. "
                   "<id>#N-1), resumed and retried alone. A resume may raise it.",
              show_default="1; a resumed job keeps its own")
@click.option("--turns", type=click.Choice(["last", "all"]),
              help="A conversation's replies to generate: the last (after the dataset's own "
                   "earlier replies), or all, each in the context of the target's own earlier "
                   "ones: one row per conversation.",
              show_default="last; a resumed job keeps its own")
@click.option("--gpus", metavar="all|N|GPUS",
              help="The GPUs the job uses, among every node's registered ones (a node that joins "
                   "later included): all, N (gpu0..gpuN-1 of each node) or names "
                   "(gpu0@node-a,gpu1@node-b).", show_default="all; a resumed job keeps its own")
@click.option("--nodes", metavar="all|NODES",
              help="Only these nodes' GPUs (node-a,node-b).",
              show_default="all; a resumed job keeps its own")
@click.option("--bodies", type=click.Choice(["redis", "storage"]), default="redis", show_default=True,
              help="Where the prompts' texts wait: in Redis (about 750 B a prompt), or in chunks "
                   "on the output storage (S3, or an output directory every node shares) with "
                   "Redis holding about 100 B a prompt: for millions of prompts.")
@click.option("--output", metavar="DIR|s3://BUCKET/PREFIX", callback=storage_location,
              help="Where the job's batches go, kept by the job: every command finds them there "
                   "from any directory.",
              show_default="DFLASH_S3_URI, else DFLASH_OUTPUT_DIR made absolute; a resumed job "
                           "keeps its own")
@click.option("--follow", is_flag=True, help="Show progress until the job is done.")
def enqueue(dataset: str, subset, split, name: JobName, limit, samples, turns, gpus, nodes,
            bodies, output, follow, **options) -> None:
    """Store a dataset's prompts as a job and start dispatching them; resumes a known job."""
    from dflash_tasks import dispatch
    from dflash_tasks.ingest import hub
    from dflash_tasks.ingest.loader import CHUNK, PromptLoader
    from dflash_tasks.ingest.prompts import DatasetError, ReadSummary, read_prompts, with_samples
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.ledger.bodies import ChunkWriter, job_location
    from dflash_tasks.output.storage import StorageError, storage_at
    from dflash_tasks.tasks.app import app

    r = redis_or_fail()
    existing = jobs.load(r, name)
    if existing is not None:
        allowed_or_fail("enqueue", existing)
    base = existing.params if existing else jobs.GenerationParams()
    params = params_or_fail(name, base, existing=existing is not None, **options)
    kept = existing.selection if existing else jobs.GpuSelection()
    try:
        selection = jobs.GpuSelection.parse(
            gpus if gpus is not None else kept.gpus,
            "" if nodes == "all" else nodes if nodes is not None else ",".join(kept.nodes))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpus/--nodes") from None
    if (unknown := _unregistered(r, selection)) is not None:
        err_console.print(f"[yellow]warning:[/] {unknown}", highlight=False)
    where = _output_or_fail(existing, output, bodies == "storage")
    samples = _samples_or_fail(existing, samples)
    turns = _turns_or_fail(existing, turns)

    summary = ReadSummary()
    source = hub.describe(dataset, subset, split)  # as the job records it
    # A new job is `loading` until its whole dataset is stored (take.lua dispatches nothing), and
    # is removed again if the dataset cannot be read to its end. A resumed job keeps its state
    # and parameters until then.
    if existing is None:
        jobs.save(r, name, params, selection=selection, dataset=source, status=lifecycle.LOADING,
                  output=where, samples=samples, turns=turns)
    # Chunks are stored by a sender thread while the next ones are read; on a resume only the
    # prompts the job does not know yet are encoded and sent (loader.py).
    book = shared_ledger()
    # A new job dispatches from its first stored chunk (the GPUs need not wait for the whole
    # dataset): it runs from then on, and keeps what it stored whatever happens to the rest.
    dispatching = threading.Event()

    def start_dispatch(added: int) -> None:
        get_settings().failpoint("enqueue.after_chunk")
        if existing is None and added and not dispatching.is_set() and \
                book.transition(name, lifecycle.LOADING, lifecycle.RUNNING):
            dispatching.set()
            dispatch.topup_all(app, book, get_settings(), jobs.load(r, name))

    try:
        store_bodies = None
        if bodies == "storage":
            location = job_location(r, name, get_settings())
            store_bodies = ChunkWriter(r, name, location, storage_at(location, get_settings()))
        loader = PromptLoader(r, book, name, resume=existing is not None, store_bodies=store_bodies,
                              on_stored=start_dispatch)
    except jobs.JobDeleted as exc:
        raise click.ClickException(f"{exc}; nothing was stored") from None
    except BaseException:
        if existing is None:
            jobs.delete(r, name)
        raise
    try:
        prompts = with_samples(read_prompts(dataset, limit=limit, summary=summary, subset=subset,
                                            split=split, every_turn=turns == "all"), samples)
        replies = ReplyTally(prompts)
        prompts = iter(replies)
        with Progress(SpinnerColumn(), TextColumn("[bold]reading {task.description}"),
                      TextColumn("{task.completed:,} prompts"), TimeElapsedColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task(source.removeprefix(hub.HUB_PREFIX) if hub.is_named(dataset)
                                else Path(dataset).name, total=None)
            added = loader.add_all(prompts, chunk=CHUNK,
                                   progress=lambda n: bar.update(task, advance=n))
        if summary.valid == 0:
            first = f"; first problem: {summary.bad[0].reason}" if summary.bad else ""
            raise DatasetError(f"{source}: no valid prompt ({summary.rows:,} rows read, "
                               f"{len(summary.bad):,} malformed{first})")
    except BaseException as exc:
        # A dataset unreadable from some line on: the chunks read before it are stored, as the
        # message says. Anything else stops after the chunk being sent.
        if isinstance(exc, DatasetError):
            loader.keep_read()
        else:
            loader.abandon()
        gone = isinstance(exc, jobs.JobDeleted)
        removed = existing is None and not gone and not dispatching.is_set()
        if removed:
            jobs.delete(r, name)
        if (removed or gone) and store_bodies is not None and store_bodies.written:
            # The job is gone (removed again after the error, or deleted meanwhile, perhaps
            # before this enqueue's last chunk landed): its chunks are nobody's.
            try:
                store_bodies.remove_written()  # only these: a new job of its name keeps its own
            except StorageError as cleanup:
                from dflash_tasks.cli.jobs import remove_chunks_command

                left = remove_chunks_command(name, store_bodies.location, max(store_bodies.written))
                err_console.print(f"[yellow]job {name}: its prompt chunks could not be removed "
                                  f"({cleanup}); once the storage answers, run {left}[/]")
        elif loader.added:
            # The job runs on what was stored, and says it is incomplete until an enqueue of
            # its dataset ends (beat never marks it done meanwhile: finish.lua).
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else \
                f"stopped by an error ({type(exc).__name__})"
            jobs.mark_incomplete(r, name, f"the enqueue of {source} was {why} after "
                                          f"{loader.added:,} new prompts: run it again to add "
                                          "the rest")
            err_console.print(f"[yellow]job {name}: enqueue {why} after {loader.added:,} new "
                              "prompts were stored: the job is incomplete (status says so) until "
                              "the same enqueue is run again, which adds the rest[/]")
        if isinstance(exc, (DatasetError, StorageError, jobs.JobDeleted)):
            what = "deleted meanwhile" if gone else "not created" if removed else \
                f"kept its {loader.added:,} new prompts" if loader.added else "unchanged"
            raise click.ClickException(f"{exc} (job {name} {what})") from None
        raise

    get_settings().failpoint("enqueue.before_apply")
    expect, changes = _final_write(existing, dispatching.is_set(), params, selection, source,
                                   samples)
    if turns == "all" and replies.prompts:  # its ETA counts the replies (progress.py)
        changes["replies_per_prompt"] = f"{replies.mean:.4f}"
    wrong = book.update_job(name, expect, changes)
    if not wrong:
        jobs.mark_incomplete(r, name, None)  # its dataset is all stored now
    if wrong:
        stored = f"its {added:,} new prompts are stored and counted" if added else \
            "no new prompt was stored"
        read = existing.stored if existing else {"status": lifecycle.LOADING}
        raise click.ClickException(
            f"{changed_meanwhile(name, read, wrong)}; {stored}, but this enqueue's parameters and "
            "GPU selection were not applied: run it again to apply them")
    job = jobs.load(r, name)
    if job is None:  # a `delete` that came after this enqueue's last write
        raise click.ClickException(f"job {name} was deleted just after this enqueue stored its "
                                   "prompts: it no longer exists")
    state = job.status
    dropped = [g for g in dispatch.dispatched_gpus(r, name) if not selection.allows(g)]
    if existing is not None and selection != existing.selection and dropped:
        # take.lua gives these GPUs nothing more; what they hold goes to the GPUs kept.
        back = sum(dispatch.withdraw(book, name, gpu, everything=True) for gpu in dropped)
        console.print(f"job {name}: now on {selection.describe()}; {back:,} prompts in flight on "
                      f"{', '.join(dropped)} went back to pending")
    if state == lifecycle.RUNNING:
        dispatch.topup_all(app, book, get_settings(), job)
    elif existing is not None and existing.status == lifecycle.PAUSED:
        err_console.print(f"job {name} stays paused: `manage.py resume --job {name}` dispatches it")
    _print_enqueue_summary(r, job, summary, added, params,
                           dispatch.serving_gpus(book, get_settings(), job))
    if follow:
        _watch(r, name)


def _output_or_fail(existing: jobs.Job | None, output: str | None, bodies_on_storage: bool) -> str:
    """Where the job's batches go: a new job's --output (else the deployment's), checked before
    anything is stored; a resumed job's own, which no enqueue changes."""
    from dflash_tasks.output.storage import check_output

    s = get_settings()
    named = "--output" if output else "DFLASH_S3_URI" if s.s3_uri else "DFLASH_OUTPUT_DIR"
    if existing is not None:
        kept = existing.output or s.output_location()
        asked = output if output is None or output.startswith("s3://") else \
            str(Path(output).expanduser().resolve())
        if asked is not None and asked != kept:
            raise click.BadParameter(f"job {existing.name} keeps its batches in {kept}; a job's "
                                     "output location does not change (a new job can have "
                                     "another)", param_hint="--output")
        if not bodies_on_storage:  # nothing is written there by this enqueue
            return kept
        output, named = kept, "the job's output"
    try:
        return check_output(output or s.output_location(), s, named=named)
    except ValueError as exc:
        raise click.ClickException(f"{exc}; nothing was stored") from None


def _final_write(existing: jobs.Job | None, started: bool, params, selection,
                 dataset: str, samples: int) -> tuple[dict, dict]:
    """What an enqueue writes into the job once its dataset is stored, and what it expects to
    find there (Ledger.update_job), against what it read before loading, seconds to minutes ago:
    a new job that already dispatches has had its settings since it was made (it must only still
    exist); a new one that does not yet, its settings and `running`; a resumed one, its new
    parameters and GPU selection, only if no one changed them, nor its state, meanwhile (a
    cancel, a pause or a `set` is never undone; beat's done, and new prompts that make a done
    job run again, count as the state read)."""
    if started:
        return {"status": list(lifecycle.STATES)}, {}
    settings = {**jobs.config_fields(params, selection), "dataset": str(dataset),
                "samples": str(samples)}
    if existing is None:
        return {"status": [lifecycle.LOADING]}, {**settings, "status": lifecycle.RUNNING}
    same = [lifecycle.RUNNING, lifecycle.DONE] \
        if existing.status in (lifecycle.RUNNING, lifecycle.DONE) else [existing.status]
    return {**existing.as_read("params", "gpus", "nodes", "samples"), "status": same}, settings


def _unregistered(r, selection: jobs.GpuSelection) -> str | None:
    """What a selection names that no worker has registered (a typo, `gpu0@lcoal`), with the
    names that are, or None. Said, not refused: a node that joins later takes the job's work
    at once. Nothing is said while no worker has registered at all (workers may start after)."""
    from dflash_tasks.dispatch import registered_gpus

    known = registered_gpus(r)
    if not known:
        return None
    nodes = sorted({g.node for g in known})
    named = [] if selection.gpus == "all" or selection.gpus.isdigit() else selection.gpus.split(",")
    registered = set(known)
    lost = [n for n in selection.nodes if n not in nodes] + \
        [g for g in named if g not in registered]
    if not lost:
        return None
    return (f"no worker has registered {', '.join(lost)}: the job waits for one (registered: "
            f"{', '.join(known) if named else 'nodes ' + ', '.join(nodes)})")


def _samples_or_fail(existing: jobs.Job | None, samples: int | None) -> int:
    """The job's samples per prompt: a new job's --samples (1 by default); a resumed job's own,
    or more (the samples it lacks are added). Fewer would leave rows no prompt asks for, and a
    job of one sample has rows under the prompts' own ids, which no sample id continues."""
    if existing is None:
        return samples or 1
    kept = existing.samples
    if samples is None or samples == kept:
        return kept
    if kept == 1:
        raise click.ClickException(f"job {existing.name} has one sample per prompt (its rows "
                                   f"carry the prompts' own ids): --samples {samples} needs a new "
                                   "job; nothing was stored")
    if samples < kept:
        raise click.ClickException(f"job {existing.name} has {kept} samples per prompt: a resume "
                                   f"adds samples, never takes them back (--samples {samples}); "
                                   "nothing was stored")
    return samples


class ReplyTally:
    """The prompts read, counting the replies each asks for (core/conversation.py)."""

    def __init__(self, prompts):
        self.source, self.prompts, self.replies = prompts, 0, 0

    def __iter__(self):
        from dflash_tasks.core.conversation import replies

        for prompt in self.source:
            self.prompts += 1
            self.replies += replies(prompt.messages)
            yield prompt

    @property
    def mean(self) -> float:
        return self.replies / self.prompts if self.prompts else 1.0


def _turns_or_fail(existing: jobs.Job | None, turns: str | None) -> str:
    """The job's turns: a new job's --turns ("last" by default), a resumed job's own. Its
    prompts' ids and scripts depend on it: another would be another job."""
    if existing is None:
        return turns or "last"
    if turns is not None and turns != existing.turns:
        raise click.ClickException(f"job {existing.name} generates --turns {existing.turns}: "
                                   f"--turns {turns} needs a new job; nothing was stored")
    return existing.turns


def _print_enqueue_summary(r, job, summary, added, params, serving: list[str]) -> None:
    from dflash_tasks.ledger import shared_ledger

    c = shared_ledger().counters(job.name)
    total, done, failed = c.get("total", 0), c.get("completed", 0), c.get("failed", 0)
    for bad in summary.bad[:20]:
        err_console.print(f"[yellow]skipped[/] {bad.reason}")
    if len(summary.bad) > 20:
        err_console.print(f"[yellow]... and {len(summary.bad) - 20} more skipped rows[/]")
    for line, prompt_id, first in summary.duplicate_rows:
        err_console.print(f"[yellow]skipped[/] {summary.unit} {line}: duplicate id "
                          f"{escape(repr(prompt_id))} (the prompt of {summary.unit} {first} is "
                          "kept)", highlight=False)
    if summary.duplicates > len(summary.duplicate_rows):
        err_console.print(f"[yellow]... and {summary.duplicates - len(summary.duplicate_rows)} "
                          "more duplicate ids[/]")
    table = Table(title=f"job {job.name}", show_header=False, box=None)
    for label, value in [
        ("rows read", summary.rows), ("valid prompts", summary.valid),
        ("skipped (malformed)", len(summary.bad)), ("duplicate ids in dataset", summary.duplicates),
        *([("samples per prompt", job.samples)] if job.samples > 1 else []),
        *([("turns", "every assistant reply, in the target's own context")]
          if job.turns == "all" else []),
        ("new prompts queued", added), ("prompts in job", total), ("already done", done),
        ("failed", failed), ("remaining", max(0, total - done - failed)),
        ("gpus", f"{job.selection.describe()}: "
                 + (f"{len(serving)} with a live worker now" if serving else
                    "no live worker yet (each takes work when it starts)")),
        ("params", f"max_tokens={params.max_tokens} temperature={params.temperature} "
                   f"top_p={params.top_p} top_k={params.top_k} min_p={params.min_p} "
                   f"repetition_penalty={params.repetition_penalty} "
                   f"thinking={params.enable_thinking}"),
    ]:
        table.add_row(label, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(table)


# -- status -------------------------------------------------------------------------------------

def _snapshot(r, name: JobName) -> dict:
    from dflash_tasks.output.progress import snapshot

    job_or_fail(r, name)
    return snapshot(r, name, get_settings())


def _bar(fraction: float, width: int = 30) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def _beat_ticking(age_s: float | None) -> bool:
    """Beat ticks every progress_interval_s; a few missed ticks are a busy control worker."""
    return age_s is not None and age_s < max(30.0, 6 * get_settings().progress_interval_s)


def _status_table(snap: dict, width: int | None = None) -> Table:
    """The run at a glance: the same figures as progress.json, for a terminal. Labels are short
    and the bar narrows with the terminal, so at 80 columns (or piped: rich's 80) every figure
    keeps its unit on its line; a long value (the per-GPU lines, a storage error) wraps inside
    its cell."""
    width = width or console.width
    t = Table(title=f"job {snap['job']}: {snap['status']}", show_header=False, box=None)
    t.add_column("what", no_wrap=True)
    t.add_column("value", overflow="fold")
    done = snap["completed"] + snap["failed"]
    fraction = done / snap["total"] if snap["total"] else 0.0
    eta = _duration(snap["eta_hours"])
    figures = f"{done:,}/{snap['total']:,} ({100 * fraction:.1f}%)  eta {eta}"
    label_width = 18  # the longest label, "completed / failed"; 4 more for the cells' padding
    bar = max(5, min(30, width - label_width - 4 - 1 - len(figures)))
    t.add_row("progress", f"{_bar(fraction, bar)} {figures}")
    if snap.get("incomplete"):
        t.add_row("[red]incomplete[/]", snap["incomplete"])
    t.add_row("completed / failed", f"{snap['completed']:,} / {snap['failed']:,}  "
                                    f"(retries {snap.get('retries', 0):,})")
    t.add_row("waiting", f"pending {snap['pending']:,}, in flight {snap['in_flight']:,}, "
                         f"retry wait {snap.get('retry_waiting', 0):,}")
    if turns := snap.get("turns"):  # a job of conversations: a row once its last reply is made
        t.add_row("replies", f"{turns['replies']:,} made; {snap['completed']:,} conversations "
                             "done")
    t.add_row("rate", f"{snap['rate_per_sec']:.2f} completions/s, "
                      f"{snap['output_tokens_per_sec']:,.0f} output tokens/s")
    t.add_row("tokens in / out", f"{snap['total_input_tokens']:,} / {snap['total_output_tokens']:,} "
                                 f"(avg out {snap['avg_output_tokens']:,.0f})")
    t.add_row("finish reasons", (", ".join(f"{k}={v:,}" for k, v in sorted(snap["finish_reasons"].items()))
                                 or "none yet")
              + f"  (truncated {snap['truncated_pct']:.1f}%)")
    if (cut := snap.get("truncated") or {}).get("rows"):
        t.add_row("truncated", f"{cut['looping']:,} looping, {cut['progressing']:,} still "
                               f"progressing (`manage.py stats --job {snap['job']}` says more)")
    where = snap.get("output") or "local"
    t.add_row("batches", f"{snap['batches']:,} ({snap['batch_bytes']:,} bytes, {where}), "
                         f"{snap['unsealed_rows']:,} rows waiting")
    if snap.get("spooled_batches"):
        t.add_row("[yellow]spool[/]", f"{snap['spooled_batches']:,} batches "
                                      f"({snap['spooled_bytes']:,} bytes) on beat's disk, "
                                      "uploaded in order when the storage answers")
    if snap.get("storage_error"):
        t.add_row("[red]storage error[/]", str(snap["storage_error"].get("error")))
    if held := snap.get("dispatch_held"):
        why = ("no sealed batch can leave Redis (the storage error above)"
               if held["reason"] == "storage" else held["error"])
        t.add_row("[red]dispatch held[/]", f"{why}: no new work starts until this clears, "
                                           "then it resumes by itself")
    if snap["status"] in ("running", "cancelled") and not _beat_ticking(snap.get("beat_age_s")):
        age = snap.get("beat_age_s")
        t.add_row("[red]beat[/]", ("no tick ever" if age is None else f"no tick for {age:,.0f} s")
                  + ": nothing is sealed, shipped or marked done; start `manage.py beat` (one per "
                    "deployment)")
    for gpu, g in snap["gpus"].items():
        alive = "[green]alive[/]" if g.get("alive") else "[red]no heartbeat[/]"
        if g.get("alive") and g.get("state", "serving") != "serving":
            alive = f"[red]{g['state']}: {g.get('state_reason') or '?'}[/]"
        t.add_row(gpu, f"{g['worker'] or '-'} {alive}: {g['completed']:,} done, "
                       f"{g['in_flight']} in flight"
                       f"{(', %d waiting to retry' % g['retry_waiting']) if g.get('retry_waiting') else ''}, "
                       f"{g.get('output_tokens_per_sec', 0):,.0f} tok/s, {g.get('retries', 0)} retries")
        server = g.get("server")
        if server and not server.get("error"):  # a family the server does not serve counts 0
            t.add_row("", f"server: {server.get('running') or 0:.0f} running, "
                          f"{server.get('queued') or 0:.0f} queued, "
                          f"{server.get('gen_throughput') or 0:,.0f} tok/s "
                          f"({server.get('age_s') or 0:.0f} s ago)")
    return t


def _duration(hours: float | None) -> str:
    """An ETA as an operator reads it: hours from one hour up, else minutes, else seconds."""
    if hours is None:
        return "-"
    if hours >= 1:
        return f"{hours:.2f} h"
    return f"{hours * 60:.0f} min" if hours * 60 >= 1 else f"{hours * 3600:.0f} s"


def _watch(r, name: JobName) -> str:
    """The status panel, refreshed every second until the job is done or cancelled; returns
    that state. Ctrl-C stops the watching, not the job, and says so (exit 130, the shell's)."""
    try:
        with Live(_status_table(_snapshot(r, name)), console=console, refresh_per_second=1) as live:
            while True:
                snap = _snapshot(r, name)
                live.update(_status_table(snap))
                if snap["status"] in ("done", "cancelled"):
                    return snap["status"]
                get_settings().failpoint("status.watching")
                time.sleep(1.0)
    except KeyboardInterrupt:
        err_console.print(f"stopped watching; job {name} goes on (`manage.py status --job {name} "
                          "--watch` watches it again)", highlight=False)
        raise SystemExit(130) from None


@click.command()
@job_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable, progress.json's names.")
@click.option("--watch", is_flag=True,
              help="Refresh every second until the job is done (exit 0) or cancelled (exit 1).")
def status(name: JobName, as_json: bool, watch: bool) -> None:
    """A job's counters, rate and ETA."""
    r = redis_or_fail()
    if watch:
        if _watch(r, name) == "cancelled":
            raise SystemExit(1)
    elif as_json:
        click.echo(json.dumps(_snapshot(r, name), indent=1))
    else:
        console.print(_status_table(_snapshot(r, name)))
