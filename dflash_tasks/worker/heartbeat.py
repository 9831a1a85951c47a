"""GPU workers' liveness and the one-worker-per-GPU rule. Celery's own worker heartbeats travel
as events, not as Redis state, so each GPU worker stamps `dflash:workers:seen` (gpu -> Redis
server time) from a daemon thread. A worker that is killed stops stamping; one stopped cleanly
removes its stamp. Readers compare the stamp with Redis time, so the nodes' clocks never matter.

Every stamp is a claim of the GPU's name (lua/claim_gpu.lua): a worker registers only while
no other worker (another host, or another live process) holds the name with a fresh heartbeat,
so two nodes started with the same DFLASH_NODE cannot share, and drain, each other's queues."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Callable

import redis

from dflash_tasks.core.keys import WORKERS, WORKERS_SEEN, GpuName
from dflash_tasks.core.scripts import Script
from dflash_tasks.ledger import Ledger

log = logging.getLogger(__name__)
CLAIM_GPU = Script(__file__, "claim_gpu")
# A heartbeat younger than this many periods holds the GPU's name (progress.py's ALIVE_PERIODS).
FRESH_PERIODS = 3


class GpuTaken(RuntimeError):
    """Another live worker holds the GPU's name; the message names both."""


def identity() -> dict:
    """Who this worker is, in its registration: its host and process."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _holder_is_dead(holder: dict) -> bool:
    """A holder on this very host whose process is gone (a killed predecessor): its heartbeat may
    still look fresh, but nobody stamps it any more."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, TypeError, OSError):
        return False
    return False


def claim_gpu(r: redis.Redis, gpu: GpuName, registration: str, fresh_s: float, *,
              release: bool = False) -> str:
    """Register this worker for `gpu` and stamp its heartbeat, unless another holds the name
    with a heartbeat younger than fresh_s (claim_gpu.lua); with `release`, remove the stamp if
    it is ours. Returns "" when done, else the holder's registration JSON."""
    held = CLAIM_GPU(r, workers=WORKERS, seen=WORKERS_SEEN, gpu=gpu,
                     registration=registration, fresh_s=fresh_s,
                     mode="release" if release else "claim")
    return held.decode() if isinstance(held, bytes) else held


def claim(book: Ledger, gpu: GpuName, registration: str, interval_s: float,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Register this worker for `gpu` and stamp its heartbeat. A holder that stops stamping
    (killed elsewhere) is waited out, FRESH_PERIODS heartbeats at most; one on this host whose
    process is gone is replaced at once; one that keeps stamping raises GpuTaken."""
    fresh_s = FRESH_PERIODS * interval_s
    deadline = time.monotonic() + fresh_s + interval_s
    while True:
        holder_raw = claim_gpu(book.r, gpu, registration, fresh_s)
        if not holder_raw:
            return
        holder = json.loads(holder_raw)
        if _holder_is_dead(holder):
            claim_gpu(book.r, gpu, registration, -1)
            return
        if time.monotonic() > deadline:
            me = json.loads(registration)
            raise GpuTaken(
                f"{gpu} is held by the worker on host {holder.get('host')} (pid {holder.get('pid')}), "
                f"whose heartbeat is still fresh; this worker on host {me.get('host')} (pid "
                f"{me.get('pid')}) refuses to start: give each node its own name (DFLASH_NODE or "
                "--node), or stop the other worker first")
        sleep(interval_s)


def run(book: Ledger, gpu: GpuName, registration: str, interval_s: float, stop: threading.Event,
        on_taken: Callable[[str], None]) -> None:
    """Stamp gpu's heartbeat now and every interval_s until `stop` (the worker runtime's thread).
    When another worker has taken the name meanwhile (this one was frozen longer than a fresh
    heartbeat), on_taken(holder) is told, once, and stamping stops."""
    while True:
        try:
            holder = claim_gpu(book.r, gpu, registration, FRESH_PERIODS * interval_s)
            if holder:
                on_taken(holder)
                return
        except redis.exceptions.RedisError as exc:
            log.warning("%s: heartbeat not written (%s)", gpu, exc)
        if stop.wait(interval_s):
            return


def clear(book: Ledger, registrations: dict[str, str]) -> None:
    """A clean shutdown removes the stamps it still owns, so the GPUs read as not alive at once."""
    for gpu, registration in registrations.items():
        try:
            claim_gpu(book.r, gpu, registration, 0, release=True)
        except redis.exceptions.RedisError:
            pass
