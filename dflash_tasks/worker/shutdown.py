"""A GPU worker's warm shutdown (SIGTERM), as its prompts see it.

Celery's warm shutdown stops consuming and waits for the tasks that are running. Here:

- a task that has not sent its request yet (waiting on an open breaker, or started after the
  signal) puts its prompt back in its queue at once (`Reject(requeue=True)`);
- a request in flight gets `shutdown_grace_s` (0 by default) to finish; then it is aborted on
  the server (`/abort_request` with its rid), the server answers "abort" with what it had
  generated, and the task hands that over (generate.py): the prompt goes back to pending with its
  partial output, and another GPU continues it from there; a generation is neither thrown away
  nor waited for. An abort that carries no partial output puts the prompt back in its queue;
- prefetched messages and retries waiting for their ETA are unacknowledged: kombu's Redis
  transport restores them to their queue when the worker closes its channel.

So a warm shutdown returns every prompt to the broker within the grace period, and a SIGKILL
loses nothing either (unacknowledged messages come back after the visibility timeout).
"""
from __future__ import annotations

import itertools
import logging
import threading
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple

log = logging.getLogger(__name__)


class _Request(NamedTuple):
    job: str
    prompt_id: str
    rid: str
    abort: Callable[[], None]


class Shutdown:
    """The process's shutdown state: whether one was requested, and the requests in flight, by
    job and prompt, that it aborts once their grace period is over (and that a move aborts one
    prompt's of: abort_prompt). The worker runtime holds the process's one."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._in_flight: dict[int, _Request] = {}
        self._tokens = itertools.count(1)

    @staticmethod
    def request_id(job: str, prompt_id: str, attempt: int) -> str:
        """A new request's rid: a random token of fixed length first, then what it is for (read
        in the logs). SGLang's `/abort_request` aborts every request whose rid starts with the
        one given, so no rid may begin another's: each begins with its own token, whatever the
        prompt ids (free text: `job:x:1:…`, prompt `x:1`'s, begins with `job:x:`)."""
        return f"{uuid.uuid4().hex}:{job}:{prompt_id}:{attempt}"

    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds; True as soon as a shutdown is requested."""
        return self._event.wait(timeout)

    @contextmanager
    def tracked(self, job: str, prompt_id: str, rid: str,
                abort: Callable[[], None]) -> Iterator[None]:
        """Register a request in flight for the job's prompt, so a shutdown past its grace period
        can abort it, or a move of that prompt (abort_prompt)."""
        token = next(self._tokens)
        with self._lock:
            self._in_flight[token] = _Request(job, prompt_id, rid, abort)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.pop(token, None)

    def abort_prompt(self, job: str, prompt_id: str) -> int:
        """Abort the requests in flight of exactly this prompt of this job (a generation moved to
        another GPU, worker/migration.py), never another's: returns how many (two only when a
        stray second delivery of it runs too)."""
        with self._lock:
            matched = [req for req in self._in_flight.values()
                       if req.job == job and req.prompt_id == prompt_id]
        for req in matched:
            req.abort()
        return len(matched)

    def begin(self, grace_s: float) -> None:
        """Called once from the worker's shutdown signal (in the main thread: only cheap work)."""
        if self._event.is_set():
            return
        self._event.set()
        threading.Thread(target=self._abort_after, args=(grace_s,), name="dflash-shutdown",
                         daemon=True).start()

    def _abort_after(self, grace_s: float) -> None:
        with self._lock:
            count = len(self._in_flight)
        if count:
            log.warning("warm shutdown: %d request(s) in flight get %.0fs to finish, then are "
                        "aborted and their prompts go back to the queue", count, grace_s)
        threading.Event().wait(grace_s)
        with self._lock:
            pending = list(self._in_flight.values())
        if pending:
            log.warning("warm shutdown: aborting %d request(s) still in flight", len(pending))
        for req in pending:
            try:
                req.abort()
            except Exception:  # best effort: the request's own timeout still bounds it
                log.exception("could not abort %s", req.rid)
