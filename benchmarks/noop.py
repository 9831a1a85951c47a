"""Celery's own floor on this machine: a worker draining no-op tasks from the same kind of Redis
broker, with the delivery settings the project's GPU workers use (JSON, acks late, prefetch 1,
threads pool). No result is stored and no event is sent: this is the least a Celery task costs.

    DFLASH_NOOP_BROKER=redis://... celery -A benchmarks.noop worker -Q noop -P threads -c 40
"""
from __future__ import annotations

import os

from celery import Celery

app = Celery("noop", broker=os.environ.get("DFLASH_NOOP_BROKER", "redis://127.0.0.1:6379/0"))
app.conf.update(task_serializer="json", accept_content=["json"], task_acks_late=True,
                worker_prefetch_multiplier=1, task_ignore_result=True, task_default_queue="noop",
                worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)


@app.task(name="noop")
def noop(job: str, prompt_id: str, gpu: str) -> None:
    return None
