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
_started: dict[int, threading.Event] = {}
_lock = threading.Lock()


def beat_once(r: redis.Redis, gpu: int) -> None:
    seconds, micros = r.time()
    r.hset(WORKERS_SEEN, queue_for(gpu), f"{seconds + micros / 1e6:.3f}")


def start(gpu: int, interval_s: float | None = None) -> None:
    """Stamp gpu's heartbeat now and every interval_s from a daemon thread (once per process)."""
    from dflash_tasks.core.connections import redis_client
    from dflash_tasks.core.settings import get_settings

    interval = interval_s or get_settings().worker_heartbeat_s
    with _lock:
        if gpu in _started:
            return
        stop = _started[gpu] = threading.Event()
    r = redis_client()

    def run() -> None:
        while True:
            try:
                beat_once(r, gpu)
            except redis.exceptions.RedisError as exc:
                log.warning("gpu%d: heartbeat not written (%s)", gpu, exc)
            if stop.wait(interval):
                return

    threading.Thread(target=run, name=f"heartbeat gpu{gpu}", daemon=True).start()


def stop_all() -> None:
    """A clean shutdown: stop stamping and remove the stamps, so the GPU reads as not alive."""
    from dflash_tasks.core.connections import redis_client

    with _lock:
        gpus = list(_started)
        for gpu in gpus:
            _started.pop(gpu).set()
    if gpus:
        try:
            redis_client().hdel(WORKERS_SEEN, *[queue_for(g) for g in gpus])
        except redis.exceptions.RedisError:
            pass


def seen(r: redis.Redis) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(WORKERS_SEEN).items()}
