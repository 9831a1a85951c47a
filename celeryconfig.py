"""Celery configuration, read by dflash_tasks.celery_app with config_from_object("celeryconfig").

Values that depend on the deployment come from DFLASH_* environment variables (settings.py).
"""
from datetime import timedelta

from dflash_tasks.settings import get_settings

_s = get_settings()

broker_url = _s.redis_url
result_backend = _s.redis_url
include = ["dflash_tasks.tasks.generate", "dflash_tasks.tasks.control"]

# JSON only: a worker never unpickles what it reads from the broker.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# At-least-once delivery: a task is acknowledged after it ran, and a task whose worker died is
# delivered again. The ledger makes the second delivery harmless.
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1

# A message not acknowledged within the visibility timeout is delivered again, running or not:
# it must exceed the longest generation plus its wait in the worker. Same value for the result
# backend, or its pub/sub reconnects behave differently.
broker_transport_options = {"visibility_timeout": _s.visibility_timeout_s}
result_backend_transport_options = {"visibility_timeout": _s.visibility_timeout_s}
broker_connection_retry_on_startup = True

# Results are small summaries kept an hour: enough for Flower and debugging, bounded in memory.
result_expires = 3600

# Prompt tasks go to their GPU's queue explicitly; everything else (beat) to `control`, so
# progress and uploads never wait behind prompts.
task_default_queue = "control"
task_create_missing_queues = True

task_send_sent_event = True
worker_send_task_events = True

beat_schedule = {
    "tick": {"task": "dflash_tasks.tick", "schedule": timedelta(seconds=_s.progress_interval_s),
             "options": {"queue": "control", "expires": _s.progress_interval_s * 2}},
    "maintain": {"task": "dflash_tasks.maintain", "schedule": timedelta(seconds=30),
                 "options": {"queue": "control", "expires": 60}},
}
