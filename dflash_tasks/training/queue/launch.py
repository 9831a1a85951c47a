"""Beat's side of training runs: launch the runs whose data is ready, send again the runs a
stopping worker handed back, and queue again the runs whose worker died.

A run waits for its trigger: `after-done`, the job done (every row shipped and the final
progress.json written); `min-rows N`, N rows shipped in batches (or the job done with fewer:
all there will be). Then it is queued, exactly once (a compare-and-set on its status), and the
training worker takes it; the quality gate runs there, on the data as it is at that moment.
"""
from __future__ import annotations

import logging
import time

import redis

from dflash_tasks.core import jobs
from dflash_tasks.core.keys import JobName
from dflash_tasks.core.settings import Settings
from dflash_tasks.output.batches import stored_records
from dflash_tasks.training.queue import runs

log = logging.getLogger(__name__)


def beat(r: redis.Redis, s: Settings, send) -> None:
    """Beat's launch_training, every few seconds: launch, send again, queue again (each a
    compare-and-set per run), over the unfinished runs read once."""
    active = [run for name in runs.names(r) if (run := runs.load(r, name)) and not run.final]
    launch_ready(r, active, send)
    send_unsent(r, active, send)
    requeue_lost(r, s, active, send)


def shipped_rows(r: redis.Redis, job: JobName) -> int:
    """Rows in batches a training run can read: in the storage, not waiting in beat's spool."""
    return sum(rec["rows"] for rec in stored_records(r, job))


def is_ready(r: redis.Redis, run: runs.Run) -> bool:
    name = JobName(run.job)  # as the run's record in Redis has it
    job = jobs.load(r, name)
    if job is None:
        return False
    if job.status == "done":
        return True
    return run.trigger == "min-rows" and shipped_rows(r, name) >= run.min_rows


def launch_ready(r: redis.Redis, candidates: list[runs.Run], send) -> list[str]:
    """Queue every waiting run whose trigger holds; returns their names."""
    launched = []
    for run in candidates:
        name = run.name
        if run.status != runs.WAITING or not is_ready(r, run):
            continue
        if runs.transition(r, name, (runs.WAITING,), runs.QUEUED, queued_at=time.time()):
            send(name)
            launched.append(name)
            log.info("training run %s: job %s is ready (%s): queued for the training workers",
                     name, run.job, run.trigger)
    return launched


def send_unsent(r: redis.Redis, candidates: list[runs.Run], send) -> list[str]:
    """Send the message of each run a stopping worker handed back (runs.mark_unsent)."""
    sent = []
    for run in candidates:
        name = run.name
        if run.status == runs.QUEUED and run.get("unsent") and runs.claim_unsent(r, name):
            send(name)
            sent.append(name)
            log.info("training run %s: handed back by a stopping worker: sent to the training "
                     "workers again", name)
    return sent


def requeue_lost(r: redis.Redis, s: Settings, candidates: list[runs.Run], send) -> list[str]:
    """Queue again the running runs whose heartbeat stopped (their worker died: killed, or its
    node lost); past train_max_restarts, fail them. Returns the names queued again."""
    now = runs.redis_now(r)
    queued = []
    for run in candidates:
        name = run.name
        if run.status != runs.RUNNING:
            continue
        beat_at = float(run.get("heartbeat_at") or 0)
        if now - beat_at < s.train_stale_s:
            continue
        restarts = int(run.get("restarts") or 0)
        silent = f"no heartbeat from {run.get('worker') or 'its worker'} for {now - beat_at:.0f}s"
        if restarts >= s.train_max_restarts:
            if runs.transition(r, name, (runs.RUNNING,), runs.FAILED, phase="", task_id="",
                               error=f"{silent}, after {restarts} restarts: given up"):
                log.error("training run %s: %s after %d restarts: failed", name, silent, restarts)
            continue
        # task_id cleared: should the silent task come back, its next write finds the run is
        # no longer its own, and it stops.
        if runs.transition(r, name, (runs.RUNNING,), runs.QUEUED, phase="", task_id="",
                           restarts=restarts + 1, restart_reason=f"{silent}: queued again"):
            send(name)
            queued.append(name)
            log.warning("training run %s: %s: queued again (restart %d of %d); it resumes from "
                        "its last checkpoint", name, silent, restarts + 1, s.train_max_restarts)
    return queued
