"""Beat's tasks, on the `control` queue: seal batches and write progress.json (tick), keep every
GPU's window full and re-dispatch lost prompts (maintain)."""
from __future__ import annotations

import json
import logging

from .. import dispatch, jobs
from ..batches import BatchPolicy, BatchWriter
from ..celery_app import app
from ..connections import ledger, redis_client
from ..progress import is_finished, snapshot
from ..settings import get_settings
from ..storage import storage_for

log = logging.getLogger(__name__)
ACTIVE = ("running", "paused")


def batch_writer() -> BatchWriter:
    s = get_settings()
    return BatchWriter(redis_client(), ledger(), storage_for(s), BatchPolicy.from_settings(s))


def tick_job(name: str) -> dict:
    """Seal what is ready, mark the job done when everything is sealed, write progress.json."""
    r, s = redis_client(), get_settings()
    snap = snapshot(r, name, s)
    all_answered = snap["completed"] + snap["failed"] >= snap["total"] and snap["pending"] == 0
    batch_writer().flush(name, final=all_answered)
    snap = snapshot(r, name, s)
    if snap["status"] == "running" and is_finished(snap):
        jobs.set_status(r, name, "done")
        snap["status"] = "done"
        log.info("job %s: done, %d completed, %d failed", name, snap["completed"], snap["failed"])
    storage_for(s).put(f"{name}/progress.json", json.dumps(snap, indent=1).encode())
    return snap


@app.task(name="dflash_tasks.tick", ignore_result=True)
def tick() -> None:
    r = redis_client()
    for name in jobs.names(r):
        job = jobs.load(r, name)
        if job and job.status in ACTIVE:
            tick_job(name)


@app.task(name="dflash_tasks.maintain", ignore_result=True)
def maintain() -> None:
    r, s = redis_client(), get_settings()
    for name in jobs.names(r):
        job = jobs.load(r, name)
        if not job or job.status != "running":
            continue
        for gpu in range(job.gpus):
            reaped = dispatch.reap(app, name, gpu, s.reap_after_s)
            if reaped:
                log.warning("job %s gpu%d: %d prompts dispatched again (no outcome after %ds)",
                            name, gpu, reaped, s.reap_after_s)
            dispatch.topup(app, name, gpu)
