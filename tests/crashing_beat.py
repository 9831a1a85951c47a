"""A real beat (the Celery arguments of `manage.py beat`, in this process) that exits right after
one step of sealing a batch, as abruptly as SIGKILL but at an exact point:

    python tests/crashing_beat.py after_intent|after_upload|after_record|after_manifest|after_delete

Each step ends with one call (output/batches.py's five steps); this wraps that call from outside,
so the production code carries no crash hook. The log says "crashing_beat: exiting after STEP"
before the exit."""
from __future__ import annotations

import logging
import os
import sys
from functools import wraps

import redis

from dflash_tasks.cli.processes import beat_args, celery_argv
from dflash_tasks.output import sealing
from dflash_tasks.output.batches import BatchWriter
from dflash_tasks.output.storage import LocalStorage, S3Storage

STEPS = ("after_intent", "after_upload", "after_record", "after_manifest", "after_delete")


def crash(step: str) -> None:
    logging.getLogger("crashing_beat").critical("crashing_beat: exiting after %s", step)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    os._exit(70)


def after(cls, method: str, step: str, when=lambda result, *args, **kwargs: True) -> None:
    """cls.method (a class's, or a module's function) runs, then the process exits if `when`
    says this call ends the step."""
    original = getattr(cls, method)

    @wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if when(result, *args, **kwargs):
            crash(step)
        return result

    setattr(cls, method, wrapper)


def arm(step: str) -> None:
    if step == "after_intent":  # the intent is the SET NX of the job's `sealing` key
        after(redis.Redis, "set", step, lambda result, _self, name, *a, nx=False, **k:
              bool(result) and nx and str(name).endswith(":sealing"))
    elif step == "after_upload":  # the batch file's put (not the manifest's, not progress.json)
        for storage in (S3Storage, LocalStorage):
            after(storage, "put", step, lambda result, _self, key, *a, **k: "/batches/" in key)
    elif step == "after_record":
        after(sealing, "record_batch", step)
    elif step == "after_manifest":
        after(BatchWriter, "write_manifest", step)
    elif step == "after_delete":  # the one call that removes the batch's rows (drop_sealed.lua)
        after(sealing, "drop_sealed", step)
    else:
        raise SystemExit(f"unknown step {step!r}: one of {', '.join(STEPS)}")


def main() -> None:
    arm(sys.argv[1])
    from celery.bin.celery import main as celery

    sys.argv = celery_argv(beat_args())
    celery()


if __name__ == "__main__":
    main()
