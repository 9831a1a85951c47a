"""A worker's life as Celery signals it, however it was launched (`manage.py worker` or plain
`celery -A dflash_tasks worker -Q gpu3@node-a`), connected explicitly by `connect`: refuse a
Redis that persists nothing, wait until its SGLang server is healthy before taking work,
learn the server's thinking contract (chat template, reasoning parser: every row records them),
register its concurrency (the dispatch window is sized from it), start its reports, fill its
queue; on a reconnect, put back what no task holds; on a stop, hand its prompts back (the
runtime's shutdown) and remove its heartbeat."""
from __future__ import annotations

import json
import logging
import time
from typing import Callable

from celery import bootsteps, signals
from celery.worker.state import active_requests, reserved_requests

from dflash_tasks import dispatch
from dflash_tasks.core import jobs
from dflash_tasks.core.connections import PersistenceError, check_persistence
from dflash_tasks.core.keys import GpuName
from dflash_tasks.core.settings import redact_url
from dflash_tasks.sglang import DeploymentError, SGLangClient, SGLangError
from dflash_tasks.worker import heartbeat
from dflash_tasks.worker.breaker import publish_closed, publish_waiting
from dflash_tasks.worker.runtime import runtime

log = logging.getLogger(__name__)
HEALTH_WARN_EVERY_S = 60.0


def gpus_consumed(app) -> list[GpuName]:
    """The GPUs whose queues this worker consumes (a GPU's queue bears its name)."""
    return GpuName.among(app.amqp.queues.consume_from or {})


def _size_http_pools(sender, instance, **_):
    """The SGLang clients get a connection per thread of this worker (runtime.pool_size); the
    runtime makes them at the first task, after this."""
    runtime().concurrency = instance.concurrency


def _wait_for_servers(sender, instance, conf, **_):
    for gpu in gpus_consumed(instance.app):
        url = runtime().settings.sglang_url_for(gpu)
        # Registered and stamping its heartbeat from its start, so `status` lists it while it
        # waits, with why (its breaker published open: nothing is dispatched to it meanwhile).
        registration = _claim(gpu, instance.concurrency, sender, url)
        runtime().start_reporting(gpu, registration)
        await_server(runtime().r, gpu, url, runtime().settings.health_wait_s,
                     say=lambda line, gpu=gpu: log.warning("%s: %s", gpu, line))
        # What a dead predecessor published is cleared, then the server's identity decides.
        publish_closed(runtime().r, gpu, url)
        _learn_contract(gpu, url)
        log.info("%s: worker %s ready, concurrency %d, server %s", gpu, sender,
                 instance.concurrency, redact_url(url))


def await_server(r, gpu: GpuName, url: str, max_wait_s: float, *,
                 say: Callable[[str], object] = log.warning,
                 on_probe: Callable[[], object] | None = None) -> None:
    """Until the server's /health answers 200 (a server loads for minutes), published as the
    GPU's state: "waiting_for_server" while nothing answers or it starts (503), "misconfigured"
    when the URL answers but not as SGLang does (404, 401, 403: the wrong --sglang-url); each
    with the URL and the answer, said a line a minute. `on_probe`: after each probe (the worker
    command stamps its heartbeat there before Celery runs). Past max_wait_s it gives up waiting,
    and says so."""
    client = SGLangClient(url)
    started, since, next_line = time.monotonic(), time.time(), 0.0
    try:
        while True:
            status, said = client.health()
            if status == 200:
                return
            waited = time.monotonic() - started
            if waited > max_wait_s:
                say(f"{redact_url(url)} still not healthy after {waited:.0f}s; taking work anyway")
                return
            misconfigured = status in (401, 403, 404)
            reason = (f"{redact_url(url)}/health answered {said}: not an SGLang server (is the "
                      "worker's --sglang-url right?)" if misconfigured else
                      f"waiting for SGLang at {redact_url(url)}/health for {waited:.0f}s: {said}")
            publish_waiting(r, gpu, url, "misconfigured" if misconfigured else "waiting_for_server",
                            reason, since)
            if on_probe is not None:
                on_probe()
            if waited >= next_line:  # a server loads for minutes: a line a minute, not every poll
                say(reason)
                next_line = waited + HEALTH_WARN_EVERY_S
            time.sleep(2.0)
    finally:
        client.close()


def _learn_contract(gpu: GpuName, url: str) -> None:
    """Ask the server once for what every row of this GPU records besides the request: its chat
    template's fingerprint, its reasoning parser and its model (the process's client caches
    them; a server that is not SGLang, or not the right one, opens the breaker). A server
    without a reasoning parser leaves the reasoning inside `content`: say so now, not after a
    day of generation."""
    client = runtime().client(gpu)
    try:
        contract = client.contract()
        client.served_model()  # learnt now: a server restarted with another model is found out
    except DeploymentError as exc:  # not SGLang, or not the right one: take no work (breaker.py)
        runtime().breaker(gpu).trip(exc.reason, str(exc), client.identity_ok)
        return
    except SGLangError as exc:  # the first task asks again
        log.warning("%s: could not read %s/server_info (%s); the first task asks again", gpu,
                    redact_url(url), exc)
        return
    log.info("%s: chat template %s, reasoning parser %s", gpu, contract.chat_template,
             contract.reasoning_parser or "none")
    if contract.reasoning_parser is None:
        log.warning("%s: %s runs without --reasoning-parser: thinking-mode rows will have their "
                    "reasoning inside content", gpu, redact_url(url))


def _claim(gpu: GpuName, concurrency: int, hostname: str, url: str) -> str:
    """Register this worker for the GPU (its concurrency sizes the dispatch window), refusing to
    start while another live worker holds the GPU's name (heartbeat.claim). Returns the
    registration, which every heartbeat claims again."""
    registration = json.dumps({
        "concurrency": concurrency, "hostname": hostname, **heartbeat.identity(),
        "url": redact_url(url), "started_at": time.time()})
    try:
        heartbeat.claim(runtime().book, gpu, registration, runtime().settings.worker_heartbeat_s)
    except heartbeat.GpuTaken as exc:
        log.critical("%s", exc)
        raise SystemExit(2) from None
    return registration


def _stop_reporting(**_):
    runtime().stop_reporting()


def _fill_queues(sender, **_):
    gpus = gpus_consumed(sender.app)
    r = runtime().r
    for name in jobs.names(r):
        job = jobs.load(r, name)
        if job and job.status == "running":
            for gpu in gpus:  # only where the job's selection allows the GPU (take.lua)
                dispatch.topup(sender.app, runtime().book, runtime().settings, name, gpu)


def _begin_shutdown(sig=None, how=None, **_):
    """Warm shutdown: tasks not yet sending hand their prompts back at once, requests in flight
    get shutdown_grace_s, then are aborted and handed back (shutdown.py)."""
    runtime().shutdown.begin(runtime().settings.shutdown_grace_s if how == "Warm" else 0.0)


def _check_failure_settings(sender, instance, conf, **_):
    """Say at start-up when the visibility timeout is shorter than the longest a message can
    legitimately stay unacknowledged (it is then delivered again while still being worked on:
    harmless for the output, wasteful for the GPU)."""
    if not gpus_consumed(instance.app):
        return
    s = runtime().settings
    if s.visibility_timeout_s < s.longest_unacked_s():
        log.warning("DFLASH_VISIBILITY_TIMEOUT_S=%d is shorter than the longest a prompt's message "
                    "can stay unacknowledged here (%.0fs: request timeout + retry wait + breaker "
                    "wait): long tasks will be delivered twice (the ledger keeps one row)",
                    s.visibility_timeout_s, s.longest_unacked_s())


class RestoreOnConnect(bootsteps.StartStopStep):
    """A consumer step, so it runs at every (re)connection of a GPU worker, before it consumes:
    the unacknowledged messages of its queues that it does not hold go back in the queue
    (dispatch.restore_unheld). At start-up those are what a killed predecessor held; after a
    Redis restart, this worker's own retries waiting for their ETA, which Celery forgets with
    the lost connection (Consumer.on_close) while their messages sit in `unacked`: without
    this they would come back only after the visibility timeout (4 h)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c):
        queues = gpus_consumed(c.app)
        if not queues:
            return
        held = {tag for request in (*tuple(active_requests), *tuple(reserved_requests))
                if (tag := getattr(getattr(request, "message", None), "delivery_tag", None))}
        try:
            restored = dispatch.restore_unheld(c.app, runtime().r, queues, held)
        except Exception:  # never stop a reconnect: the visibility timeout still restores them
            log.exception("could not look for unacknowledged messages of %s", ", ".join(queues))
            return
        if restored:
            log.warning("%s: %d unacknowledged message(s) no running task holds (retries waiting "
                        "before a reconnect, or what a previous worker held) are back in the "
                        "queue", ", ".join(queues), restored)


def _quiet_httpx(**_):
    """httpx logs every request at INFO: at 40 requests in flight per GPU that would drown the
    worker's log."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _quiet_per_task_lines(loglevel=logging.INFO, **_):
    """Celery logs two INFO lines per task (received, succeeded): CPU a GPU worker feels at
    hundreds of completions a second (benchmarks/RESULTS.md, case 4), for nothing the ledger,
    progress.json and Flower do not say better. They come back with --loglevel DEBUG. Retries,
    failures and the worker's own lines are logged as before."""
    if isinstance(loglevel, str):
        loglevel = logging.getLevelName(loglevel.upper())
    if loglevel > logging.DEBUG:
        for name in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _refuse_redis_without_persistence(sender=None, **_):
    """However the worker was launched: a Redis that persists nothing loses every prompt's
    state on a restart (connections.check_persistence)."""
    try:
        check_persistence(runtime().r, runtime().settings)
    except PersistenceError as exc:
        log.critical("%s", exc)
        raise SystemExit(2) from None


def connect(app) -> None:
    """Wire a worker's life to its runtime, for `app` (tasks/app.py calls it once). The
    receivers are module functions, held strongly; dispatch_uid makes a second call harmless."""
    for signal, receiver in ((signals.worker_init, _quiet_httpx),
                             (signals.after_setup_logger, _quiet_per_task_lines),
                             (signals.worker_init, _refuse_redis_without_persistence),
                             (signals.celeryd_after_setup, _size_http_pools),
                             (signals.celeryd_after_setup, _wait_for_servers),
                             (signals.celeryd_after_setup, _check_failure_settings),
                             (signals.worker_ready, _fill_queues),
                             (signals.worker_shutting_down, _begin_shutdown),
                             (signals.worker_shutdown, _stop_reporting)):
        signal.connect(receiver, weak=False, dispatch_uid=f"dflash_tasks.{receiver.__name__}")
    if RestoreOnConnect not in app.steps["consumer"]:
        app.steps["consumer"].add(RestoreOnConnect)
