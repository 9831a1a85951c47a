"""Celery configuration, read by dflash_tasks.tasks.app: the module's names are the settings
that do not depend on the deployment (config_from_object("celeryconfig")); `deployment(s)`
gives those that do, from the process's Settings (DFLASH_* variables, settings.py). Importing
this module reads no setting."""
from datetime import timedelta

from dflash_tasks.core.keys import CONTROL_QUEUE, LAUNCH_TRAINING_TASK, MAINTAIN_TASK, TICK_TASK
from dflash_tasks.core.settings import Settings

include = ["dflash_tasks.tasks.generate", "dflash_tasks.tasks.control", "dflash_tasks.tasks.train"]

# JSON only: a worker never unpickles what it reads from the broker. A message in another
# serializer (or whose body does not decode) is logged and acknowledged once, never retried.
task_serializer = "json"
result_serializer = "json"
event_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# At-least-once delivery: a task is acknowledged after it ran, and a task whose worker died is
# delivered again. The ledger makes the second delivery harmless.
task_acks_late = True
task_reject_on_worker_lost = True
# A worker reserves no more messages than it has threads: while its breaker holds every thread,
# the rest of its window stays in the broker (visible in Flower), not in the worker's memory.
worker_prefetch_multiplier = 1

# Redis restarts (a day-long run sees them): workers and beat reconnect by themselves, forever.
broker_connection_retry_on_startup = True
broker_connection_retry = True
broker_connection_max_retries = None
# A publish (a retry, a window top-up, beat's schedule) waits out a Redis restart of up to about
# five minutes instead of failing: 0, 1, 2, 3, 4, then every 5 s.
task_publish_retry = True
task_publish_retry_policy = {"max_retries": 60, "interval_start": 0, "interval_step": 1,
                             "interval_max": 5}
# Storing a result retries on connection errors too, then gives up (the row is in the ledger
# already; a lost result only shows in Flower).
result_backend_always_retry = True
result_backend_max_retries = 30
result_backend_base_sleep_between_retries_ms = 200
result_backend_max_sleep_between_retries_ms = 10_000
redis_retry_on_timeout = True
redis_socket_keepalive = True
redis_backend_health_check_interval = 25
# A lost broker connection does not stop the generations running: their rows are recorded
# through the ledger, and a message redelivered later is skipped as done.
worker_cancel_long_running_tasks_on_connection_loss = False

# Stored results (training runs'; a prompt's task stores none) are kept an hour: bounded in memory.
result_expires = 3600

# Prompt tasks go to their GPU's queue explicitly; everything else (beat) to `control`, so
# progress and uploads never wait behind prompts.
task_default_queue = CONTROL_QUEUE
task_create_missing_queues = True

# Task events only while someone watches: Flower asks every worker to send them (its
# enable_events broadcast, every 5 s while it runs), and they cost a GPU worker a good share of
# its CPU at hundreds of completions a second (benchmarks/RESULTS.md, case 4: the rate with
# Flower on and off). Workers' heartbeat events go out either way.
task_send_sent_event = True
worker_send_task_events = False


def deployment(s: Settings) -> dict:
    """The settings that depend on the deployment: its Redis, the visibility timeout, beat's
    periods."""
    # The broker's transport is kombu's Redis transport (its Sentinel one for sentinel:// URLs)
    # with two fixes (dflash_tasks/worker/transport.py), registered for redis:// and sentinel://
    # URLs by dflash_tasks/tasks/app.py, not named here. A sentinel:// result backend is Celery's
    # SentinelBackend. The password stays out of the URLs (Celery masks these settings'
    # values): the broker's and the result backend's, for a URL that has none.
    password = s.redis_password_value()
    # Both find the master of this name through the sentinels at every reconnect.
    sentinel = {"master_name": s.redis_master_name, "sentinel_kwargs": s.sentinel_kwargs()} \
        if s.sentinels() else {}
    # A message not acknowledged within the visibility timeout is delivered again, running or
    # not: it must exceed the longest a message stays unacknowledged in a worker (Settings.
    # longest_unacked_s: request timeout + retry wait + breaker wait, about 42 minutes by
    # default, against 4 hours; a worker warns at start-up when it does not). A copy delivered
    # anyway is harmless: the ledger records a prompt once. Same value for the result backend,
    # or its pub/sub reconnects behave differently. Workers look for expired messages every
    # unacked_restore_interval_s (kombu's own default scans only every 10th tick of 10 s).
    broker_transport_options = {
        "visibility_timeout": s.visibility_timeout_s,
        "unacked_restore_interval": s.unacked_restore_interval_s,
        "unacked_restore_throttle": 1,
        "socket_keepalive": True,
        "health_check_interval": 25,
        # master_password: kombu loses broker_password when a failover moves it to the next
        # sentinel (dflash_tasks/worker/transport.py's SentinelChannel).
        **({**sentinel, "master_password": password} if sentinel else {}),
    }
    result_backend_transport_options = {"visibility_timeout": s.visibility_timeout_s, **sentinel}
    beat_schedule = {
        "tick": {"task": TICK_TASK, "schedule": timedelta(seconds=s.progress_interval_s),
                 "options": {"queue": CONTROL_QUEUE, "expires": s.progress_interval_s * 2}},
        "maintain": {"task": MAINTAIN_TASK, "schedule": timedelta(seconds=s.maintain_interval_s),
                     "options": {"queue": CONTROL_QUEUE, "expires": s.maintain_interval_s * 2}},
        "launch-training": {"task": LAUNCH_TRAINING_TASK,
                            "schedule": timedelta(seconds=s.progress_interval_s),
                            "options": {"queue": CONTROL_QUEUE,
                                        "expires": s.progress_interval_s * 2}},
    }
    return {"broker_url": s.redis_url, "result_backend": s.redis_url,
            "broker_password": password, "redis_password": password,
            "broker_transport_options": broker_transport_options,
            "result_backend_transport_options": result_backend_transport_options,
            "beat_schedule": beat_schedule}
