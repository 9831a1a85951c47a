"""The training runs' tasks: `train`, on the `train` queue (`manage.py worker --queue train`,
concurrency 1, on a GPU node): one training run, as training/queue/execute.py describes; and
beat's `launch_training`, which queues the runs whose data is ready (training/queue/launch.py).

Acknowledged on receipt, not after it ran: a run lasts days, far past the broker's visibility
timeout, after which an unacknowledged message would be delivered again and a second copy
started. A run whose worker dies is found by its stale heartbeat instead (beat's launch_training)
and queued again; the trainer resumes from its last checkpoint.
"""
from __future__ import annotations

from dflash_tasks.core.connections import redis_client
from dflash_tasks.core.keys import LAUNCH_TRAINING_TASK, TRAIN_QUEUE, TRAIN_TASK
from dflash_tasks.core.settings import get_settings
from dflash_tasks.tasks.app import app
from dflash_tasks.training.queue import launch, runs
from dflash_tasks.training.queue.execute import RunSession
from dflash_tasks.worker.runtime import runtime


@app.task(name=TRAIN_TASK, bind=True, acks_late=False, track_started=True, ignore_result=False)
def train(self, run_name: str) -> dict:
    r = redis_client()
    run = runs.load(r, run_name)
    if run is None:
        return {"run": run_name, "status": "unknown", "started": False}

    def publish_state(meta: dict) -> None:
        if self.request.id:
            self.update_state(state="PROGRESS", meta=meta)

    session = RunSession(r, run, get_settings(), publish_state=publish_state,
                         shutdown=runtime().shutdown,
                         hostname=self.request.hostname or "", task_id=self.request.id)
    return session.execute()


def send(run_name: str) -> None:
    """Queue the run's task for the training workers."""
    app.send_task(TRAIN_TASK, args=[run_name], queue=TRAIN_QUEUE)


def training_workers(timeout: float = 1.0) -> list[str]:
    """Whether a training worker is alive, by Celery's own ping to the workers named as
    `manage.py worker --queue train` names them (train@HOST): the first answer is enough."""
    replies = app.control.ping(timeout=timeout, limit=1, pattern=f"{TRAIN_QUEUE}@*",
                               matcher="glob")
    return sorted(host for reply in replies for host in reply)


@app.task(name=LAUNCH_TRAINING_TASK, ignore_result=True)
def launch_training() -> None:
    """Beat's: launch the runs whose trigger holds, send again those never sent, queue again
    those whose worker died."""
    launch.beat(redis_client(), get_settings(), send)
