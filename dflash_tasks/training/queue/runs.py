"""Training runs in Redis: one hash per run (`keys.train_run`), listed in `keys.TRAIN_RUNS`.

Fields of a run's hash (JSON where marked):

- run, job, trainer ("reference" | "command"), trigger ("now" | "after-done" | "min-rows"),
  min_rows, spec (JSON: the gate, reference and command sections of --config; the command's
  template by name, never a command line: the training node holds those);
- status: waiting -> queued -> running -> done | failed | refused | cancelled; created_at,
  queued_at, started_at, finished_at; attempts (times a worker started it); restarts (times it
  was handed back or found lost and queued again) and restart_reason (the latest);
- while running: worker, task_id (the Celery task that owns the run: Flower shows its state;
  every write of a running task checks it still owns the run, so a task given up for dead that
  comes back stops instead of competing with its successor), heartbeat_at (Redis time),
  phase ("gate", "smoke", "export", "train", "eval", "upload"), step, metrics (JSON: the
  latest), log_tail (JSON: the last lines of its log), run_dir, log_path;
- at the end: exit_code and duration_s (command), checkpoints (JSON list of {name, path,
  step, uri}), uploaded (JSON: checkpoint names already in S3), gate (JSON: the quality gate's
  verdict), smoke (JSON: the overfit gate's verdict, with [smoke]), evals (JSON list: tau and
  acceptance by position of each checkpoint on held-out prompts, with [eval]), error;
- cancel_requested: set by `manage.py train-cancel`, read by the running task;
- unsent: a queued run handed back by a worker's warm shutdown, whose message beat sends.

Every status change goes through `transition`, a compare-and-set in Lua, so beat, a worker, a
redelivered message and train-cancel can race without a run starting twice or a cancelled run
coming back.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from dflash_tasks.core.keys import TRAIN_RUNS, JobName, check_job_name, train_run, train_seq
from dflash_tasks.core.scripts import Script

WAITING, QUEUED, RUNNING = "waiting", "queued", "running"
DONE, FAILED, REFUSED, CANCELLED = "done", "failed", "refused", "cancelled"
FINAL = (DONE, FAILED, REFUSED, CANCELLED)
TRAIN_RUN_SET = Script(__file__, "train_run_set")

_JSON_FIELDS = ("spec", "metrics", "log_tail", "checkpoints", "uploaded", "gate", "smoke",
                "evals")
_INT_FIELDS = ("attempts", "restarts", "exit_code", "step", "cancel_requested")
_FLOAT_FIELDS = ("created_at", "queued_at", "started_at", "finished_at", "heartbeat_at",
                 "duration_s")


class RunExists(ValueError):
    pass


@dataclass
class Run:
    name: str
    job: str
    trainer: str
    status: str
    trigger: str = "now"
    min_rows: int = 0
    spec: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)  # everything else, decoded

    def get(self, name: str, default=None):
        return self.fields.get(name, default)

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def as_dict(self) -> dict:
        return {"run": self.name, "job": self.job, "trainer": self.trainer, "status": self.status,
                "trigger": self.trigger, "min_rows": self.min_rows, **self.fields}


def _encode(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def create(r: redis.Redis, job: JobName, trainer: str, spec: dict, *, trigger: str,
           min_rows: int = 0, name: str | None = None) -> Run:
    """A new run, waiting for its trigger (or queued, for "now": the caller sends its task)."""
    name = check_job_name(name) if name else f"{job}-train-{r.incr(train_seq(job))}"
    key = train_run(name)
    now = time.time()
    if not r.hsetnx(key, "run", name):
        raise RunExists(f"training run {name} exists already "
                        f"(`manage.py train-status --run {name}`)")
    status = QUEUED if trigger == "now" else WAITING
    r.hset(key, mapping={"job": job, "trainer": trainer, "spec": json.dumps(spec),
                         "trigger": trigger, "min_rows": min_rows, "status": status,
                         "created_at": now, "attempts": 0, "restarts": 0,
                         **({"queued_at": now} if status == QUEUED else {})})
    r.zadd(TRAIN_RUNS, {name: now})
    run = load(r, name)
    assert run is not None
    return run


def load(r: redis.Redis, name: str) -> Run | None:
    raw = r.hgetall(train_run(name))
    if not raw or b"status" not in raw:
        return None
    d = {k.decode(): v.decode() for k, v in raw.items()}
    for names, decode in ((_JSON_FIELDS, json.loads), (_INT_FIELDS, int), (_FLOAT_FIELDS, float)):
        for f in names:
            if d.get(f) not in (None, ""):
                d[f] = decode(d[f])
    return Run(name=d.pop("run"), job=d.pop("job"), trainer=d.pop("trainer"),
               status=d.pop("status"), trigger=d.pop("trigger", "now"),
               min_rows=int(d.pop("min_rows", 0) or 0), spec=d.pop("spec", {}), fields=d)


def names(r: redis.Redis) -> list[str]:
    """Every run, oldest first."""
    return [m.decode() for m in r.zrange(TRAIN_RUNS, 0, -1)]


def transition(r: redis.Redis, name: str, allowed: tuple[str, ...], new: str, *,
               owner: str | None = None, **fields) -> str | None:
    """Move the run to `new` if its status is one of `allowed` (and, with `owner`, if that task
    id is still its task_id), setting `fields` with it. Returns the status it had, or None when the
    condition did not hold (someone else moved it)."""
    return _set_if(r, name, ",".join(allowed), owner or "", new, fields)


def update(r: redis.Redis, name: str, *, owner: str | None = None, **fields) -> bool:
    """Set fields; with `owner`, only while that task owns the run. False when it does not."""
    if owner is None:
        r.hset(train_run(name), mapping={k: _encode(v) for k, v in fields.items()})
        return True
    return _set_if(r, name, "", owner, "", fields) is not None


def _set_if(r: redis.Redis, name: str, allowed: str, owner: str, new: str,
            fields: dict) -> str | None:
    """train_run_set.lua on the run's hash: the status it had, or None when it was not in an
    allowed state or not owned as required."""
    pairs = [x for k, v in fields.items() for x in (k, _encode(v))]
    old = TRAIN_RUN_SET(r, run=train_run(name), statuses=allowed, owner=owner, status=new,
                        fields=pairs)
    return old.decode() if old else None


def redis_now(r: redis.Redis) -> float:
    """Redis's clock: the one clock every node of a deployment shares."""
    seconds, micros = r.time()
    return seconds + micros / 1e6


def request_cancel(r: redis.Redis, name: str) -> str:
    """Cancel a run: at once when it has not started, by a flag its task reads when it runs.
    Returns "cancelled" (now), "stopping" (its worker stops it) or "final" (it had ended)."""
    if transition(r, name, (WAITING, QUEUED), CANCELLED, finished_at=time.time(),
                  error="cancelled before it started"):
        return "cancelled"
    run = load(r, name)
    if run is None:
        raise KeyError(name)
    if run.status == RUNNING:
        update(r, name, cancel_requested=1)
        return "stopping"
    return "final"


def mark_unsent(r: redis.Redis, name: str) -> None:
    """A queued run whose message a stopping worker took: beat sends it again."""
    update(r, name, unsent=1)


def claim_unsent(r: redis.Redis, name: str) -> bool:
    """True for exactly one caller when the run waits for its message to be sent again."""
    return bool(r.hdel(train_run(name), "unsent"))


def cancel_requested(r: redis.Redis, name: str) -> bool:
    return r.hget(train_run(name), "cancel_requested") == b"1"
