"""A GPU worker's warm shutdown (SIGTERM), as its prompts see it.

Celery's warm shutdown stops consuming and waits for the tasks that are running. Here:

- a task that has not sent its request yet (waiting on an open breaker, or started after the
  signal) puts its prompt back in its queue at once (`Reject(requeue=True)`);
- a request in flight gets `shutdown_grace_s` to finish; then it is aborted on the server
  (`/abort_request` with its rid), the server answers "abort", and the task puts its prompt back;
- prefetched messages and retries waiting for their ETA are unacknowledged: kombu's Redis
  transport restores them to their queue when the worker closes its channel.

So a warm shutdown returns every prompt to the broker within the grace period, and a SIGKILL
loses nothing either (unacknowledged messages come back after the visibility timeout).
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger(__name__)

_event = threading.Event()
_lock = threading.Lock()
_in_flight: dict[int, tuple[str, Callable[[], None]]] = {}
_next = 0


def requested() -> bool:
    return _event.is_set()


def wait(timeout: float) -> bool:
    """Sleep up to `timeout` seconds; True as soon as a shutdown is requested."""
    return _event.wait(timeout)


@contextmanager
def tracked(rid: str, abort: Callable[[], None]) -> Iterator[None]:
    """Register a request in flight, so a shutdown past its grace period can abort it."""
    global _next
    with _lock:
        _next += 1
        token = _next
        _in_flight[token] = (rid, abort)
    try:
        yield
    finally:
        with _lock:
            _in_flight.pop(token, None)


def begin(grace_s: float) -> None:
    """Called once from the worker's shutdown signal (in the main thread: only cheap work here)."""
    if _event.is_set():
        return
    _event.set()
    threading.Thread(target=_abort_after, args=(grace_s,), name="dflash-shutdown",
                     daemon=True).start()


def _abort_after(grace_s: float) -> None:
    with _lock:
        count = len(_in_flight)
    if count:
        log.warning("warm shutdown: %d request(s) in flight get %.0fs to finish, then are aborted "
                    "and their prompts go back to the queue", count, grace_s)
    deadline = threading.Event()
    deadline.wait(grace_s)
    with _lock:
        pending = list(_in_flight.values())
    if pending:
        log.warning("warm shutdown: aborting %d request(s) still in flight", len(pending))
    for rid, abort in pending:
        try:
            abort()
        except Exception:  # best effort: the request's own timeout still bounds it
            log.exception("could not abort %s", rid)


def reset_for_tests() -> None:
    _event.clear()
    with _lock:
        _in_flight.clear()
