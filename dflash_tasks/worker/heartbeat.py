"""GPU workers' liveness, for progress.json: Celery's own worker heartbeats travel as events,
not as Redis state, so each GPU worker stamps `dflash:workers:seen` (gpu -> Redis server time)
from a daemon thread. A worker that is killed stops stamping; one stopped cleanly removes its
stamp. Readers compare the stamp with Redis time, so the nodes' clocks never matter."""
from __future__ import annotations

import logging
import threading

import redis

from dflash_tasks.core.keys import WORKERS_SEEN, queue_for

log = logging.getLogger(__name__)


def beat_once(r: redis.Redis, gpu: str) -> None:
    seconds, micros = r.time()
    r.hset(WORKERS_SEEN, queue_for(gpu), f"{seconds + micros / 1e6:.3f}")


def run(r: redis.Redis, gpu: str, interval_s: float, stop: threading.Event) -> None:
    """Stamp gpu's heartbeat now and every interval_s until `stop` (the worker runtime's thread)."""
    while True:
        try:
            beat_once(r, gpu)
        except redis.exceptions.RedisError as exc:
            log.warning("%s: heartbeat not written (%s)", gpu, exc)
        if stop.wait(interval_s):
            return


def clear(r: redis.Redis, gpus: list[str]) -> None:
    """A clean shutdown removes the stamps, so the GPUs read as not alive at once."""
    if gpus:
        try:
            r.hdel(WORKERS_SEEN, *[queue_for(g) for g in gpus])
        except redis.exceptions.RedisError:
            pass
