"""A job's lifecycle: its states and what every command may do in each, in one table.

Every command that changes a job (and beat, which marks it done) asks `check` first; a command
that is not allowed in the job's state is refused with the state and what to run instead, and
changes nothing. docs/ARCHITECTURE.md shows the same table.

- loading:   a first enqueue is storing the dataset; nothing is dispatched.
- running:   prompts are dispatched.
- paused:    nothing new is dispatched; requests in flight finish and are kept.
- cancelled: like paused, and beat stops once the last rows are sealed. Every prompt not yet
             generated stays in the job (counted, never dropped), so `resume` finishes them all.
- done:      every prompt of the dataset is completed or in the failed registry, every row shipped.
"""
from __future__ import annotations

LOADING, RUNNING, PAUSED, CANCELLED, DONE = "loading", "running", "paused", "cancelled", "done"
STATES = (LOADING, RUNNING, PAUSED, CANCELLED, DONE)

# command -> {state it is allowed in: state it leaves the job in}; KEEP leaves the state as it is.
KEEP = "="
TRANSITIONS: dict[str, dict[str, str]] = {
    "enqueue":      {RUNNING: KEEP, PAUSED: KEEP, DONE: RUNNING},  # DONE: only with new prompts
    "pause":        {RUNNING: PAUSED},
    "resume":       {PAUSED: RUNNING, CANCELLED: RUNNING},
    "cancel":       {RUNNING: CANCELLED, PAUSED: CANCELLED},
    "set":          {RUNNING: KEEP, PAUSED: KEEP, CANCELLED: KEEP, DONE: KEEP},
    "retry-failed": {RUNNING: KEEP, PAUSED: KEEP, DONE: RUNNING},
    "regenerate":   {RUNNING: KEEP, PAUSED: KEEP, DONE: RUNNING},
    "delete":       {LOADING: KEEP, PAUSED: KEEP, CANCELLED: KEEP, DONE: KEEP},
    "finish":       {RUNNING: DONE},   # beat, once every prompt has its outcome and is shipped
}

# What to run instead, by the state that refused a command: commands to paste as they are (a
# cancel or a delete still asks to confirm).
_INSTEAD = {
    LOADING: "wait for the enqueue that is loading it, or `manage.py delete --job {job}` if "
             "that enqueue died",
    RUNNING: "`manage.py pause --job {job}` or `manage.py cancel --job {job}` first",
    PAUSED: "`manage.py resume --job {job}`",
    CANCELLED: "`manage.py resume --job {job}` generates the prompts it has left, "
               "`manage.py delete --job {job}` removes it",
    DONE: "`manage.py retry-failed --job {job}` or `manage.py regenerate --job {job} "
          "--finish-reason length` generate again, `manage.py delete --job {job}` removes it",
}


class LifecycleError(Exception):
    """A command not allowed in the job's state; the message says the state and what to do."""


def allowed(command: str, state: str) -> bool:
    return state in TRANSITIONS[command]


def check(command: str, job: str, state: str) -> str:
    """The state `command` leaves `job` in, or LifecycleError when it is not allowed now."""
    outcome = TRANSITIONS[command].get(state)
    if outcome is None:
        raise LifecycleError(f"job {job} is {state}: `{command}` is not allowed in that state; "
                             f"{_INSTEAD.get(state, 'see `manage.py jobs`').format(job=job)}")
    return state if outcome == KEEP else outcome
