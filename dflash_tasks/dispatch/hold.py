"""Dispatch held, so that Redis stays bounded whatever fails.

Every finished row waits in Redis until beat seals it into a batch and the batch leaves (to the
storage, or to the spool while the storage is down). Two things can stop that, and each holds
dispatch (take.lua gives no GPU new work while a hold is set; requests in flight finish):

- the job's hold: no sealed batch can leave Redis (storage and spool both fail: a full disk).
  Beat's tick sets it when sealing fails that way and clears it as soon as a batch leaves.
- the memory hold: Redis's used_memory is at or above `redis_memory_hold_ratio` of its
  maxmemory while rows wait to be sealed: holding lets sealing free them before Redis refuses
  a write, and the requests in flight finish meanwhile. Beat's maintain reads INFO memory (one
  cheap command every DFLASH_MAINTAIN_INTERVAL_S) and sets or clears it, so a worker's refill
  costs nothing more than before (an EXISTS inside take.lua). With no row to seal, holding
  could free nothing (what fills Redis then is what only dispatch takes away: pending prompts),
  and a hold would never clear: dispatch goes on and beat says what to raise. Without a
  maxmemory there is nothing to measure against, and no memory hold.

Held dispatch resumes by itself: nothing here needs an operator, only the cause to go away.
"""
from __future__ import annotations

import json
import logging
import time

import redis

from dflash_tasks.core.keys import MEMORY_HOLD, JobName

log = logging.getLogger(__name__)


def hold_job(r: redis.Redis, job: JobName, reason: str, error: str) -> None:
    """Hold the job's dispatch (again: `since` keeps the first time), saying why."""
    k = job.hold
    pipe = r.pipeline()
    pipe.hsetnx(k, "since", time.time())
    pipe.hset(k, mapping={"reason": reason, "error": error[:1000]})
    new = pipe.execute()[0]
    if new:
        log.warning("job %s: dispatch held (%s): %s; requests in flight finish, no new ones start "
                    "until it clears", job, reason, error[:1000])


def release_job(r: redis.Redis, job: JobName) -> None:
    k = job.hold
    held = r.hgetall(k)
    if held and r.delete(k):
        since = float(held.get(b"since", time.time()))
        log.warning("job %s: dispatch resumes after %.0fs held (%s)", job, time.time() - since,
                    held.get(b"reason", b"?").decode())


def check_memory(r: redis.Redis, ratio: float, rows_to_seal: int) -> dict | None:
    """Set or clear the memory hold from Redis's own INFO memory and the rows waiting to be
    sealed (every job's); returns the hold, or None."""
    info = r.info("memory")
    used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
    if limit and used >= ratio * limit and rows_to_seal:
        prev = r.get(MEMORY_HOLD)
        since = json.loads(prev)["since"] if prev else time.time()
        hold = {"used_memory": used, "maxmemory": limit, "ratio": ratio, "since": since,
                "rows_to_seal": rows_to_seal}
        r.set(MEMORY_HOLD, json.dumps(hold))
        if not prev:
            log.warning("Redis uses %d of its maxmemory %d bytes (hold ratio %.2f) with %d rows "
                        "waiting to be sealed: no job dispatches new work until it falls below",
                        used, limit, ratio, rows_to_seal)
        return hold
    if r.delete(MEMORY_HOLD):
        log.warning("Redis uses %d of %d bytes, %d rows to seal: dispatch resumes", used, limit,
                    rows_to_seal)
    if limit and used >= ratio * limit:
        log.warning("Redis uses %d of its maxmemory %d bytes (hold ratio %.2f) with no row to "
                    "seal: what fills it (pending prompts, about 750 B each) leaves only as it "
                    "is dispatched, so dispatch goes on; raise maxmemory, or enqueue large "
                    "datasets with --bodies storage", used, limit, ratio)
    return None
