"""Windowed dispatch: each GPU queue holds about its worker's concurrency times a small factor
of tasks; every finished task tops its own queue up from the job's pending list. So no
million-message backlog sits in the broker, and a faster GPU simply takes more prompts."""
from __future__ import annotations

import json
import math
import time

from celery import Celery

from .connections import ledger, redis_client
from .keys import WORKERS, JobKeys, queue_for
from .settings import get_settings

GENERATE = "dflash_tasks.generate"
_CAPACITY_TTL_S = 30.0
_capacity_cache: dict[int, tuple[float, int]] = {}


def worker_concurrency(gpu: int) -> int:
    """The concurrency the GPU's worker registered at start-up (cached briefly)."""
    now = time.monotonic()
    cached = _capacity_cache.get(gpu)
    if cached and now - cached[0] < _CAPACITY_TTL_S:
        return cached[1]
    raw = redis_client().hget(WORKERS, queue_for(gpu))
    concurrency = json.loads(raw)["concurrency"] if raw else get_settings().default_concurrency
    _capacity_cache[gpu] = (now, concurrency)
    return concurrency


def window_for(gpu: int) -> int:
    return max(1, math.ceil(worker_concurrency(gpu) * get_settings().window_factor))


def publish(app: Celery, job: str, gpu: int, prompt_ids: list[str]) -> None:
    if not prompt_ids:
        return
    with app.producer_or_acquire() as producer:
        for prompt_id in prompt_ids:
            app.send_task(GENERATE, args=(job, prompt_id, gpu), queue=queue_for(gpu),
                          producer=producer)


def topup(app: Celery, job: str, gpu: int) -> int:
    """Fill gpu's window for job from pending; returns how many tasks were published."""
    ids = ledger().take(job, gpu, window_for(gpu))
    publish(app, job, gpu, ids)
    return len(ids)


def reap(app: Celery, job: str, gpu: int, older_than_s: float) -> int:
    """Dispatch again the prompts dispatched long ago and still not done: their message was lost
    (a broker restart without persistence). A copy that still exists is harmless: the ledger
    counts a prompt once."""
    r = redis_client()
    key = JobKeys(job).inflight(gpu)
    now = time.time()
    stale = [m.decode() for m in r.zrangebyscore(key, "-inf", now - older_than_s, start=0, num=10_000)]
    if stale:
        r.zadd(key, {m: now for m in stale}, xx=True)
        publish(app, job, gpu, stale)
    return len(stale)
