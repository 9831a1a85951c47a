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
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger(__name__)

class Shutdown:
    """The process's shutdown state: whether one was requested, and the requests in flight that
    it aborts once their grace period is over. The worker runtime holds the process's one."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._in_flight: dict[int, tuple[str, Callable[[], None]]] = {}
        self._tokens = itertools.count(1)

    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds; True as soon as a shutdown is requested."""
        return self._event.wait(timeout)

    @contextmanager
    def tracked(self, rid: str, abort: Callable[[], None]) -> Iterator[None]:
        """Register a request in flight, so a shutdown past its grace period can abort it."""
        token = next(self._tokens)
        with self._lock:
            self._in_flight[token] = (rid, abort)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.pop(token, None)

    def abort_matching(self, prefix: str) -> int:
        """Abort the requests in flight whose rid starts with `prefix` (a prompt's: a generation
        moved to another GPU, worker/migration.py); returns how many."""
        with self._lock:
            matched = [abort for rid, abort in self._in_flight.values() if rid.startswith(prefix)]
        for abort in matched:
            abort()
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
        for rid, abort in pending:
            try:
                abort()
            except Exception:  # best effort: the request's own timeout still bounds it
                log.exception("could not abort %s", rid)
