"""The long-running processes: a GPU worker or the training worker, beat with its control
worker, Flower."""
from __future__ import annotations

import json
import os
import sys
import time

import click

from dflash_tasks.cli.common import err_console
from dflash_tasks.core.keys import CONTROL_QUEUE, TRAIN_QUEUE, GpuName, check_node_name
from dflash_tasks.core.settings import check_http_url, get_settings, redact_url

# -- processes ----------------------------------------------------------------------------------

def celery_argv(args: list[str]) -> list[str]:
    return ["celery", "-A", "dflash_tasks", *args]


def _exec_celery(args: list[str]) -> None:
    """Replace this process with Celery's, so signals (TERM for a warm shutdown) reach it."""
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", *celery_argv(args)])


# Celery's own levels, checked here: Celery's refusal of another comes after a worker has started.
LOG_LEVEL = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False)


def _server_url(ctx, param, url: str | None) -> str | None:
    try:
        return check_http_url(url) if url else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


class _OneRole(click.Command):
    """A worker is a GPU's (--gpu) or the training worker (--queue train), checked when the
    arguments are parsed (so a deployment file's typo is caught without starting anything)."""

    def parse_args(self, ctx, args):
        rest = super().parse_args(ctx, args)
        if (ctx.params.get("gpu") is None) == (ctx.params.get("queue") is None):
            raise click.UsageError("pass --gpu I (a generation worker) or --queue train (the "
                                   "training worker)", ctx)
        if ctx.params.get("queue") and ctx.params.get("concurrency") not in (None, 1):
            raise click.UsageError("the training worker runs one training at a time: "
                                   "--concurrency 1", ctx)
        return rest


@click.command(cls=_OneRole)
@click.option("--gpu", type=click.IntRange(min=0),
              help="This node's GPU I: consumes the queue gpuI@NODE (the GPU's name).")
@click.option("--node", help="This node's name, unique in the deployment.",
              show_default="DFLASH_NODE, else the host's short name")
@click.option("--queue", type=click.Choice([TRAIN_QUEUE]),
              help="train: the training worker (one run at a time; manage.py train queues runs).")
@click.option("--sglang-url", help="This GPU's SGLang server.", callback=_server_url,
              show_default="http://127.0.0.1:{30000+I}")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="Requests in flight.",
              show_default="the server's max_running_requests plus a margin")
@click.option("--loglevel", type=LOG_LEVEL, default="INFO", show_default=True,
              help="Celery's log level.")
def worker(gpu: int | None, node: str | None, queue: str | None, sglang_url: str | None,
           concurrency: int | None, loglevel: str) -> None:
    """A Celery worker pinned to one GPU's queue and server (--gpu), or the training worker
    (--queue train)."""
    from dflash_tasks.sglang import SGLangClient, SGLangError

    if queue == TRAIN_QUEUE:
        # Threads, not prefork: the run executes in this process, so a warm shutdown (TERM)
        # reaches it at once and it hands itself back to the queue from its last checkpoint.
        _exec_celery(["worker", "-Q", TRAIN_QUEUE, "-n", f"{TRAIN_QUEUE}@%h", "-P", "threads", "-c", "1",
                      "--without-gossip", "--without-mingle", "--loglevel", loglevel])

    if node is not None:
        try:
            check_node_name(node)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--node") from None
        os.environ["DFLASH_NODE"] = node  # the worker's own settings name the same node
    if sglang_url:
        os.environ["DFLASH_SGLANG_URL"] = sglang_url
    get_settings.cache_clear()
    name = GpuName.on(get_settings().node, gpu)
    url = get_settings().sglang_url_for(name)
    if concurrency is None:
        _await_server_registered(name, url)
        client = SGLangClient(url)
        try:
            slots = int(client.server_info().get("max_running_requests") or 0)
        except (SGLangError, ValueError, TypeError):
            slots = 0
        client.close()
        # A quarter more than the decode slots, so a slot freed while a thread writes its row
        # is taken by a request already waiting in the server's queue, even through a pause of
        # the worker process (GC, a busy CPU): benchmarks/RESULTS.md, case 3.
        concurrency = slots + max(4, slots // 4) if slots else get_settings().default_concurrency
        err_console.print(f"{name}: server has {slots or 'unknown'} decode slots; "
                          f"concurrency {concurrency}")
    # The GPU's queue and its Celery worker bear the GPU's name (unique in the deployment).
    _exec_celery(["worker", "-Q", name, "-n", name, "-P", "threads",
                  "-c", str(concurrency), "--without-gossip", "--without-mingle",
                  "--loglevel", loglevel])


@click.command()
@click.option("--loglevel", type=LOG_LEVEL, default="INFO", show_default=True,
              help="Celery's log level.")
def beat(loglevel: str) -> None:
    """Celery beat with a small worker for its `control` queue (progress.json, batches, refills).
    Run one per deployment; a second one by mistake corrupts nothing (locks, idempotent ticks)."""
    _exec_celery(beat_args(loglevel))


def beat_args(loglevel: str = "INFO") -> list[str]:
    """Celery's arguments for beat and its control worker."""
    schedule = get_settings().output_dir / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    return ["worker", "-B", "-s", str(schedule), "-Q", CONTROL_QUEUE, "-n", f"{CONTROL_QUEUE}@%h",
            "-P", "threads", "-c", "4", "--without-gossip", "--without-mingle",
            "--loglevel", loglevel]


def _await_server_registered(name: GpuName, url: str) -> None:
    """Wait for the server's /health before Celery starts (its concurrency comes from the
    server), registered and stamping the GPU's heartbeat meanwhile, its state published: so
    `status` lists the GPU from the worker's start, waiting or misconfigured, with why. The name
    is claimed as Celery claims it (heartbeat.py: one worker per GPU name); Celery, in this
    process, takes the claim over when it starts."""
    from dflash_tasks.ledger import shared_ledger
    from dflash_tasks.worker import heartbeat
    from dflash_tasks.worker.hooks import await_server

    s = get_settings()
    book = shared_ledger()
    registration = json.dumps({"concurrency": 0, "hostname": name, **heartbeat.identity(),
                               "url": redact_url(url), "started_at": time.time()})
    try:
        heartbeat.claim(book, name, registration, s.worker_heartbeat_s)
    except heartbeat.GpuTaken as exc:
        raise click.ClickException(str(exc)) from None
    err_console.print(f"{name}: waiting for {redact_url(url)}/health ...")
    await_server(book.r, name, url, float("inf"),
                 say=lambda line: err_console.print(f"{name}: {line}", highlight=False),
                 on_probe=lambda: heartbeat.claim_gpu(
                     book.r, name, registration, heartbeat.FRESH_PERIODS * s.worker_heartbeat_s))


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=5555, show_default=True,
              help="The port the UI listens on.")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="The address the UI listens on (0.0.0.0: every interface).")
@click.option("--no-auth", is_flag=True, help="Serve without authentication (a trusted network only).")
def flower(port: int, address: str, no_auth: bool) -> None:
    """Flower, the Celery web UI, against the broker, with basic auth from
    DFLASH_FLOWER_BASIC_AUTH (user:password[,user2:password2])."""
    secret = get_settings().flower_basic_auth
    credentials = secret.get_secret_value() if secret else ""
    if not credentials and not no_auth:
        raise click.UsageError("set DFLASH_FLOWER_BASIC_AUTH=user:password, or pass --no-auth "
                               "explicitly to serve Flower without authentication")
    if credentials:
        # Through Flower's environment, not its argv: a password on a command line shows in ps.
        os.environ["FLOWER_BASIC_AUTH"] = credentials
    _exec_celery(["flower", f"--port={port}", f"--address={address}",
                  f"--max_tasks={10_000}", "--persistent=False"])
