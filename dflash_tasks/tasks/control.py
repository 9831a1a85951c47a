"""Beat's tasks, on the `control` queue: seal batches and write progress.json, launch training
runs whose data is ready and queue again those whose worker stopped or died (tick); keep every
GPU's window full, re-dispatch lost prompts and move the prompts of a GPU whose worker is gone
(maintain)."""
from __future__ import annotations

import logging
import time
from functools import partial

import redis

from dflash_tasks import dispatch
from dflash_tasks.core import jobs
from dflash_tasks.core.connections import redis_client
from dflash_tasks.core.keys import BEAT_SEEN, MAINTAIN_TASK, TICK_TASK, JobName
from dflash_tasks.core.locks import HeldLock, LockLost
from dflash_tasks.core.settings import get_settings
from dflash_tasks.dispatch import hold
from dflash_tasks.ledger import shared_ledger
from dflash_tasks.output.batches import BatchPolicy, BatchWriter
from dflash_tasks.output.progress import (
    is_finished,
    prune_rate,
    sealing_counts,
    snapshot,
    write_progress,
)
from dflash_tasks.output.spool import Spool
from dflash_tasks.output.storage import LocalStorage, Storage, StorageError, job_output
from dflash_tasks.tasks.app import app
from dflash_tasks.training.data.monitor import sample_quality

log = logging.getLogger(__name__)
ACTIVE = ("running", "paused")
STORAGE_WARN_EVERY_S = 300  # while storage keeps failing, one warning per this many seconds


def batch_writer(storage: Storage) -> BatchWriter:
    """Beat's batch writer into a job's storage; every batch it seals is sampled for the quality
    monitor."""
    r, s = redis_client(), get_settings()
    # The spool spares Redis an S3 outage; batches kept in the local directory need none (a disk
    # that refuses them would refuse the spool too).
    spool = Spool(s.spool_path()) if getattr(storage, "is_remote", False) else None
    return BatchWriter(r, shared_ledger(), storage, BatchPolicy.from_settings(s),
                       lock_ttl_s=s.lock_ttl_s, spool=spool, on_sealed=partial(sample_quality, r))


def tick_job(name: JobName) -> dict | None:
    """Seal and ship what is ready, write progress.json, and mark the job done once everything
    is shipped. One tick per job at a time (a lock), so a second beat started by mistake only
    skips; a storage failure is logged once, shown in progress.json, and retried at the next
    tick. Returns the snapshot written, or None when another tick holds the job."""
    r, s = redis_client(), get_settings()
    lock = HeldLock(r, name.tick_lock, s.lock_ttl_s)
    if not lock.acquire():
        log.debug("job %s: another tick is running; skipped", name)
        return None
    with lock:
        job = jobs.load(r, name)
        if job is None:  # deleted since beat listed it
            return None
        storage = job_output(job, s)
        _seal_and_ship(r, s, name, storage)
        snap = snapshot(r, name, s)
        prune_rate(r, name, list(snap["gpus"]), keep_s=2 * s.rate_window_s + 60)
        finished = snap["status"] == "running" and is_finished(snap) and \
            _final_manifest(r, name, snap, storage)
        if finished:
            snap["status"] = "done"
        lock.still_held()
        beside_batches = _write_progress(r, s, name, storage, snap)
        # Done only once the final progress.json is beside the batches: a done job has no more
        # ticks, so a failed last upload is retried by staying "running" one more tick. And
        # done only if, at the instant it is written, nothing waits anywhere (finish.lua): a
        # retry-failed, a regenerate or a late row since the snapshot keeps it running, and
        # the next tick writes the job as it is then.
        if finished and beside_batches and snap["storage_error"] is None:
            s.failpoint("tick.before_finish")
            outcome = shared_ledger().finish(name)
            if outcome == "done":
                log.info("job %s: done, %d completed, %d failed", name, snap["completed"],
                         snap["failed"])
            else:  # the progress.json just written said done: it says the truth again at once
                log.info("job %s: not done after all (%s)", name, outcome)
                snap = snapshot(r, name, s)
                _write_progress(r, s, name, storage, snap)
    return snap


def _seal_and_ship(r, s, name: JobName, storage) -> None:
    """Seal and upload the full batches (every row, once every prompt has its answer; each one
    sampled for training-data quality as it is sealed). It reads a few counts, not a snapshot:
    the tick makes one snapshot, after this, for progress.json."""
    snap = sealing_counts(r, name)
    all_answered = snap["completed"] + snap["failed"] >= snap["total"] and snap["pending"] == 0
    # The error state changes only on evidence: a failed write sets it, a write that went
    # through clears it (a tick with nothing to seal proves nothing). A batch the spool took
    # left Redis, but the storage failed all the same.
    writer = batch_writer(storage)
    try:
        written = writer.flush(name, final=all_answered)
    except (StorageError, OSError) as exc:
        # The batch could go nowhere (S3 down and the spool's disk full, or the output
        # directory unwritable): its rows stay in Redis, and new work would only add to them.
        _storage_state(r, name, exc, snap["unsealed_rows"])
        hold.hold_job(r, name, "storage", str(exc))
    else:
        if written:
            hold.release_job(r, name)  # a batch left Redis: there is room again
        if writer.storage_failure is None:
            try:
                writer.write_superseded(name)
            except StorageError as exc:  # the next tick writes it; the job is not done before
                log.warning("job %s: superseded.json not written (%s)", name, exc)
        if writer.storage_failure is not None:
            _storage_state(r, name, writer.storage_failure, snap["unsealed_rows"])
        elif snap["spooled_batches"] and not getattr(storage, "is_remote", False):
            # Spooled for S3 by a beat that had it; this one has none to ship them to.
            _storage_state(r, name, StorageError(
                f"{snap['spooled_batches']} batches of job {name} wait in beat's spool for S3, but "
                "this beat runs without DFLASH_S3_URI: start beat with the S3 settings (and on "
                "the machine) it spooled them with"), snap["unsealed_rows"])
        elif written:
            _storage_state(r, name, None, snap["unsealed_rows"])


def _final_manifest(r, name: JobName, snap: dict, storage: Storage) -> bool:
    """manifest.json rewritten once more before the job is done: a rewrite that failed while
    the spool took over (batches.py goes on without it) is caught up here at the latest; and
    superseded.json lists every row a regenerate replaced."""
    try:
        writer = batch_writer(storage)
        writer.write_manifest(name)
        return writer.write_superseded(name)
    except StorageError as exc:
        _storage_state(r, name, exc, snap["unsealed_rows"])
        return False


def _write_progress(r, s, name: JobName, storage, snap: dict) -> bool:
    """progress.json beside the batches; when they go to S3, first a copy in beat's own output
    directory, which says the error while the storage fails with rows waiting (none is written
    to S3 then). True when a copy is where the batches are."""
    if not getattr(storage, "is_remote", False):
        write_progress(storage, name, snap)
        return True
    write_progress(LocalStorage(s.output_dir), name, snap)
    if snap["storage_error"] and (snap["unsealed_rows"] or snap["spooled_batches"]):
        return False
    try:
        write_progress(storage, name, snap)
    except StorageError as exc:
        _storage_state(r, name, exc, snap["unsealed_rows"])
        return False
    _storage_state(r, name, None, snap["unsealed_rows"])
    return True


def _storage_state(r, name: JobName, error: Exception | None, backlog: int) -> None:
    """Keep `storage_error` (shown in progress.json) and log a failure once when it starts, then
    once every STORAGE_WARN_EVERY_S while it lasts: no traceback every few seconds."""
    k = name.storage_error
    now = time.time()
    prev = {key.decode(): v.decode() for key, v in r.hgetall(k).items()}
    if error is None:
        if prev:
            r.delete(k)
            log.warning("job %s: storage works again after %.0fs (%s failed ticks); uploading "
                        "the %d rows that waited", name, now - float(prev.get("since", now)),
                        prev.get("failures", "?"), backlog)
        return
    message = str(error)[:1000]
    warn = (not prev or prev.get("error") != message
            or now - float(prev.get("warned_at", 0)) >= STORAGE_WARN_EVERY_S)
    pipe = r.pipeline()
    pipe.hsetnx(k, "since", now)
    pipe.hset(k, mapping={"error": message, "last_at": now, **({"warned_at": now} if warn else {})})
    pipe.hincrby(k, "failures", 1)
    pipe.execute()
    if warn:
        since = float(prev.get("since", now))
        log.warning("job %s: storage failing%s: %s; %d rows wait in Redis, sealed batches in "
                    "the spool; retried every tick", name, f" for {now - since:.0f}s" if prev else "",
                    message, backlog)


def _settled(r, job: jobs.Job) -> bool:
    """A cancelled job still has ticks to come while its last requests finish and their rows
    wait to be sealed."""
    pipe = r.pipeline(transaction=False)
    pipe.xlen(job.name.output)
    pipe.exists(job.name.sealing)
    for gpu in dispatch.dispatched_gpus(r, job.name):
        pipe.zcard(job.name.inflight(gpu))
    return not any(pipe.execute())


def _each_job(r, work) -> None:
    """work(job) for every job; one job's trouble (a bad name in dflash:jobs, a corrupt config,
    a failing tick) is logged and the others go on."""
    for name in jobs.names(r, skipped=lambda raw, exc: log.error("job %r: skipped this time: %s",
                                                                  raw, exc)):
        try:
            job = jobs.load(r, name)
            if job is not None:
                work(job)
        except LockLost as exc:
            log.warning("job %s: tick stopped: %s", name, exc)
        except Exception:
            log.exception("job %s: skipped this time", name)


@app.task(name=TICK_TASK, ignore_result=True)
def tick() -> None:
    r = redis_client()
    seconds, micros = r.time()
    r.set(BEAT_SEEN, f"{seconds + micros / 1e6:.3f}")  # status says when beat is not running

    def tick_if_active(job: jobs.Job) -> None:
        if job.status in ACTIVE or job.status == "cancelled" and not _settled(r, job):
            tick_job(job.name)

    _each_job(r, tick_if_active)


@app.task(name=MAINTAIN_TASK, ignore_result=True)
def maintain() -> None:
    r, s = redis_client(), get_settings()
    book = shared_ledger()
    try:  # no job dispatches while Redis nears its maxmemory with rows to seal (dispatch/hold.py)
        pipe = r.pipeline(transaction=False)
        for name in jobs.names(r):
            pipe.xlen(name.output)
        hold.check_memory(r, s.redis_memory_hold_ratio, sum(pipe.execute()))
    except redis.RedisError as exc:  # a Redis refusing writes already: the windows wait anyway
        log.warning("Redis memory check failed: %s", exc)
    unacked = dispatch.UnackedLook(r)  # read once for every job and GPU of this run

    def keep_windows_full(job: jobs.Job) -> None:
        if job.status != "running":
            return
        # Every GPU the job ever used (its prompts may be there) and every registered GPU its
        # selection allows, a node that joined since included: its GPUs get work now.
        gpus = dispatch.job_gpus(r, job)
        unavailable = dispatch.unavailable_gpus(r, gpus, s)
        serving = [g for g in gpus if g not in unavailable and job.selection.allows(g)]
        for gpu in gpus:
            if gpu in unavailable:
                # Nothing is sent to a GPU without a worker (its node left or died) or whose
                # server cannot take work; what waits there moves to the GPUs that can (when
                # none can, it stays: the first one back takes it).
                why = unavailable[gpu]
                back = dispatch.drain_gone(book, job.name, gpu, why.older_than_s) if serving else 0
                if back:
                    log.warning("job %s %s: %s; %d prompts in flight there went back to pending "
                                "for the other GPUs", job.name, gpu, why.why, back)
                continue
            reaped = dispatch.reap(app, book, s, job.name, gpu, unacked)
            if reaped:
                log.warning("job %s %s: %d prompts dispatched again (no outcome after %ds)",
                            job.name, gpu, reaped, s.reap_after_s)
            if gpu in serving:
                dispatch.topup(app, book, s, job.name, gpu)

    _each_job(r, keep_windows_full)
