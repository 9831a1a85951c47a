"""`manage.py`: a thin command line over the package's modules."""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from itertools import islice
from pathlib import Path

import click
import redis
from rich.console import Console
from rich.live import Live
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import jobs
from .settings import get_settings, redact_url

console = Console()
err_console = Console(stderr=True)
CHUNK = 1000


def _redis() -> redis.Redis:
    from .connections import redis_client

    r = redis_client()
    try:
        r.ping()
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(
            f"cannot reach Redis at {redact_url(get_settings().redis_url)} ({exc}); "
            "set DFLASH_REDIS_URL or start redis-server") from None
    return r


def _job_or_fail(r: redis.Redis, name: str) -> jobs.Job:
    try:
        job = jobs.load(r, name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from None
    if job is None:
        known = ", ".join(jobs.names(r)) or "none"
        raise click.ClickException(f"no job named {name!r} (known jobs: {known})")
    return job


class LazyGroup(click.Group):
    """Commands defined in other modules, imported only when used (the simulated server pulls
    in aiohttp, which `status` has no need for)."""

    lazy = {"sim-server": "dflash_tasks.sim.cli:sim_server"}

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def cli() -> None:
    """dflash-tasks: generate DFlash drafter training data with SGLang servers and Celery."""


# -- enqueue ------------------------------------------------------------------------------------

@cli.command()
@click.option("--dataset", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet file of prompts.")
@click.option("--job", "name", required=True, help="Job name; enqueue the same job again to resume.")
@click.option("--max-output-tokens", type=click.IntRange(min=1), help="Cap on generated tokens [8192].")
@click.option("--temperature", type=click.FloatRange(min=0), help="Sampling temperature [0.6].")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), help="[0.95]")
@click.option("--top-k", type=int, help="[20]")
@click.option("--thinking/--no-thinking", default=None, help="Qwen3 thinking mode [on].")
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N valid prompts.")
@click.option("--gpus", type=click.IntRange(min=1),
              help="Number of GPU queues gpu0..gpuN-1 [the registered workers, else 1].")
@click.option("--follow", is_flag=True, help="Show progress until the job is done.")
def enqueue(dataset: Path, name: str, max_output_tokens, temperature, top_p, top_k, thinking,
            limit, gpus, follow) -> None:
    """Store a dataset's prompts as a job and start dispatching them; resumes a known job."""
    from . import dispatch
    from .celery_app import app
    from .connections import ledger
    from .keys import WORKERS, check_job_name
    from .prompts import DatasetError, ReadSummary, read_prompts

    try:
        check_job_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from None
    r = _redis()
    existing = jobs.load(r, name)
    base = existing.params if existing else jobs.GenerationParams()
    try:
        params = base.replace(max_tokens=max_output_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, enable_thinking=thinking)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    gpus = gpus or (existing.gpus if existing else None) or \
        len([q for q in r.hkeys(WORKERS) if q.startswith(b"gpu")]) or 1

    summary = ReadSummary()
    added = 0
    book = ledger()
    # Paused while loading, so workers never race ahead of a half-stored job.
    job = jobs.save(r, name, params, gpus=gpus, dataset=str(dataset), status="paused")
    try:
        prompts = read_prompts(dataset, limit=limit, summary=summary)
        with Progress(SpinnerColumn(), TextColumn("[bold]reading {task.description}"),
                      TextColumn("{task.completed:,} prompts"), TimeElapsedColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task(dataset.name, total=None)
            while chunk := list(islice(prompts, CHUNK)):
                added += book.add_prompts(name, [
                    (p.id, json.dumps(p.messages, ensure_ascii=False, separators=(",", ":")))
                    for p in chunk])
                bar.update(task, advance=len(chunk))
    except DatasetError as exc:
        jobs.set_status(r, name, existing.status if existing else "paused")
        raise click.ClickException(str(exc)) from None

    jobs.set_status(r, name, "running")
    for gpu in range(gpus):
        dispatch.topup(app, name, gpu)
    _print_enqueue_summary(r, job, summary, added, params, gpus)
    if follow:
        _watch(r, name, until_done=True)


def _print_enqueue_summary(r, job, summary, added, params, gpus) -> None:
    from .connections import ledger

    c = ledger().counters(job.name)
    total, done, failed = c.get("total", 0), c.get("completed", 0), c.get("failed", 0)
    for bad in summary.bad[:20]:
        err_console.print(f"[yellow]skipped[/] {bad.reason}")
    if len(summary.bad) > 20:
        err_console.print(f"[yellow]... and {len(summary.bad) - 20} more skipped rows[/]")
    table = Table(title=f"job {job.name}", show_header=False, box=None)
    for label, value in [
        ("rows read", summary.rows), ("valid prompts", summary.valid),
        ("skipped (malformed)", len(summary.bad)), ("duplicate ids in dataset", summary.duplicates),
        ("new prompts queued", added), ("prompts in job", total), ("already done", done),
        ("failed", failed), ("remaining", max(0, total - done - failed)),
        ("gpus", f"gpu0..gpu{gpus - 1}"),
        ("params", f"max_tokens={params.max_tokens} temperature={params.temperature} "
                   f"top_p={params.top_p} top_k={params.top_k} thinking={params.enable_thinking}"),
    ]:
        table.add_row(label, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(table)


# -- status -------------------------------------------------------------------------------------

def _snapshot(r, name: str) -> dict:
    from .progress import snapshot

    _job_or_fail(r, name)
    return snapshot(r, name, get_settings())


def _status_table(snap: dict) -> Table:
    t = Table(title=f"job {snap['job']}: {snap['status']}", show_header=False, box=None)
    done = snap["completed"] + snap["failed"]
    pct = 100 * done / snap["total"] if snap["total"] else 0
    eta = f"{snap['eta_hours']:.2f} h" if snap["eta_hours"] is not None else "-"
    t.add_row("progress", f"{done:,}/{snap['total']:,} ({pct:.1f}%)  eta {eta}")
    t.add_row("completed / failed", f"{snap['completed']:,} / {snap['failed']:,}")
    t.add_row("pending / in flight", f"{snap['pending']:,} / {snap['in_flight']:,}")
    t.add_row("rate", f"{snap['rate_per_sec']:.2f} completions/s, "
                      f"{snap['output_tokens_per_sec']:,.0f} output tokens/s")
    t.add_row("tokens in / out", f"{snap['total_input_tokens']:,} / {snap['total_output_tokens']:,} "
                                 f"(avg out {snap['avg_output_tokens']:,.0f})")
    t.add_row("finish reasons", ", ".join(f"{k}={v:,}" for k, v in sorted(snap["finish_reasons"].items()))
              + f"  (truncated {snap['truncated_pct']:.1f}%)")
    t.add_row("batches", f"{snap['batches']:,} ({snap['batch_bytes']:,} bytes), "
                         f"{snap['unsealed_rows']:,} rows waiting")
    for gpu, g in snap["gpus"].items():
        t.add_row(gpu, f"{g['completed']:,} done, {g['in_flight']} in flight, "
                       f"worker {g['worker'] or '-'}")
    return t


def _watch(r, name: str, until_done: bool) -> None:
    from .progress import is_finished

    with Live(_status_table(_snapshot(r, name)), console=console, refresh_per_second=1) as live:
        while True:
            snap = _snapshot(r, name)
            live.update(_status_table(snap))
            if until_done and (is_finished(snap) or snap["status"] in ("done", "cancelled")):
                return
            time.sleep(1.0)


@cli.command()
@click.option("--job", "name", required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable, progress.json's names.")
@click.option("--watch", is_flag=True, help="Refresh every second until interrupted.")
def status(name: str, as_json: bool, watch: bool) -> None:
    """A job's counters, rate and ETA."""
    r = _redis()
    if watch:
        _watch(r, name, until_done=False)
    elif as_json:
        click.echo(json.dumps(_snapshot(r, name), indent=1))
    else:
        console.print(_status_table(_snapshot(r, name)))


# -- processes ----------------------------------------------------------------------------------

def _exec_celery(args: list[str]) -> None:
    """Replace this process with Celery's, so signals (TERM for a warm shutdown) reach it."""
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "celery", "-A", "dflash_tasks", *args])


@cli.command()
@click.option("--gpu", type=click.IntRange(min=0), required=True, help="GPU index I: consumes queue gpuI.")
@click.option("--sglang-url", help="This GPU's SGLang server [http://127.0.0.1:{30000+I}].")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="Requests in flight [the server's max_running_requests plus a margin].")
@click.option("--loglevel", default="INFO", show_default=True)
def worker(gpu: int, sglang_url: str | None, concurrency: int | None, loglevel: str) -> None:
    """A Celery worker pinned to one GPU's queue and server."""
    from .sglang import SGLangClient, SGLangError

    if sglang_url:
        os.environ["DFLASH_SGLANG_URL"] = sglang_url
        get_settings.cache_clear()
    url = get_settings().sglang_url_for(gpu)
    if concurrency is None:
        client = SGLangClient(url)
        err_console.print(f"gpu{gpu}: waiting for {redact_url(url)}/health ...")
        while not client.wait_healthy(timeout_s=60):
            err_console.print(f"gpu{gpu}: {redact_url(url)} not healthy yet, still waiting")
        try:
            slots = int(client.server_info().get("max_running_requests") or 0)
        except (SGLangError, ValueError, TypeError):
            slots = 0
        client.close()
        # A few more than the decode slots, so a slot freed while a thread writes its row is
        # taken by a request already waiting in the server's queue.
        concurrency = slots + max(2, slots // 8) if slots else get_settings().default_concurrency
        err_console.print(f"gpu{gpu}: server has {slots or 'unknown'} decode slots; "
                          f"concurrency {concurrency}")
    _exec_celery(["worker", "-Q", f"gpu{gpu}", "-n", f"gpu{gpu}@%h", "-P", "threads",
                  "-c", str(concurrency), "-E", "--without-gossip", "--without-mingle",
                  "--loglevel", loglevel])


@cli.command()
@click.option("--loglevel", default="INFO", show_default=True)
def beat(loglevel: str) -> None:
    """Celery beat with a small worker for its `control` queue (progress.json, batches, refills).
    Run one per deployment; a second one by mistake corrupts nothing (locks, idempotent ticks)."""
    schedule = get_settings().output_dir / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    _exec_celery(["worker", "-B", "-s", str(schedule), "-Q", "control", "-n", "control@%h",
                  "-P", "threads", "-c", "4", "-E", "--without-gossip", "--without-mingle",
                  "--loglevel", loglevel])


@cli.command()
@click.option("--port", type=int, default=5555, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True)
@click.option("--no-auth", is_flag=True, help="Serve without authentication (a trusted network only).")
def flower(port: int, address: str, no_auth: bool) -> None:
    """Flower, the Celery web UI, against the broker, with basic auth from
    DFLASH_FLOWER_BASIC_AUTH (user:password[,user2:password2])."""
    credentials = os.environ.get("DFLASH_FLOWER_BASIC_AUTH", "")
    if not credentials and not no_auth:
        raise click.UsageError("set DFLASH_FLOWER_BASIC_AUTH=user:password, or pass --no-auth "
                               "explicitly to serve Flower without authentication")
    if credentials:
        # Through Flower's environment, not its argv: a password on a command line shows in ps.
        os.environ["FLOWER_BASIC_AUTH"] = credentials
    _exec_celery(["flower", f"--port={port}", f"--address={address}",
                  f"--max_tasks={10_000}", "--persistent=False"])


def main() -> None:
    cli(prog_name="manage.py")
