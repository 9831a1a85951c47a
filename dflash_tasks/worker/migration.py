"""A GPU worker's side of moving a generation to a faster GPU (the end game, take.lua): a daemon
thread pops the generations take.lua ordered moved off this GPU and aborts each one's request
on the server. The request's own task then receives the partial output and hands it over
(tasks/generate.py, dispatch/lua/hand_over.lua). An order for a request not running here (finished
meanwhile, waiting for a retry) is dropped: the order lapses, and nothing is lost."""
from __future__ import annotations

import logging
import threading

import redis

from dflash_tasks.core.keys import GpuName
from dflash_tasks.dispatch import window
from dflash_tasks.ledger import Ledger
from dflash_tasks.worker.shutdown import Shutdown

log = logging.getLogger(__name__)
POLL_S = 1.0


def run(book: Ledger, gpu: GpuName, running: Shutdown, stop: threading.Event) -> None:
    """Until `stop`: abort the requests of the generations ordered moved off `gpu`."""
    while not stop.is_set():
        try:
            order = window.migrations(book.r, gpu, POLL_S)
        except redis.exceptions.RedisError as exc:
            log.debug("%s: migrations not read (%s)", gpu, exc)
            stop.wait(POLL_S)
            continue
        if order is None:
            continue
        job, prompt_id = order
        if running.abort_prompt(job, prompt_id):  # its own request only: ids are free text
            log.info("%s: prompt %s of job %s aborted here, to be continued on a faster GPU",
                     gpu, prompt_id, job)
