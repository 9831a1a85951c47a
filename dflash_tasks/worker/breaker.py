"""A circuit breaker per worker process and SGLang server (the worker runtime holds them).

    closed ──(threshold consecutive transient failures)──▶ open
    open: no request is sent; one thread probes /health with exponential backoff
    open ──(close_after consecutive 200s from /health)──▶ closed

A server that stops answering (crashed, restarting, hung) would otherwise make every prompt in
the worker burn its retries against it; with the breaker, the worker's threads wait (a task waits
*before* sending its request, so a prompt whose request was never sent spends no attempt), the
worker takes no new messages while its threads wait, its queued prompts stay in the broker, and
it resumes by itself once /health has answered 200 several times in a row. SGLang's /health also
answers 503 while starting or while a long prefill delays it, so one answer never decides.

A breaker that opens again soon after it closed (a server whose /health says 200 while its
requests fail) stays open longer each time, so a flapping server cannot turn into a retry storm.

The state is published (best effort) in Redis under `dflash:breakers` for `manage.py failed`
and logged at every change.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Callable

import redis

from dflash_tasks.core.keys import BREAKERS, queue_for
from dflash_tasks.core.settings import redact_url
from dflash_tasks.worker.shutdown import Shutdown

log = logging.getLogger(__name__)

CLOSED, OPEN = "closed", "open"


class CircuitBreaker:
    def __init__(self, name: str, probe: Callable[[], bool], *, threshold: int = 10,
                 close_after: int = 3, probe_base_s: float = 1.0, probe_cap_s: float = 30.0,
                 on_change: Callable[["CircuitBreaker"], None] | None = None,
                 shutdown: Shutdown | None = None, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self._shutdown = shutdown or Shutdown()  # the process's: waiters and probes stop at it
        self._probe = probe
        self.threshold = max(1, threshold)
        self.close_after = max(1, close_after)
        self.probe_base_s = probe_base_s
        self.probe_cap_s = max(probe_cap_s, probe_base_s)
        self._on_change = on_change
        self._clock = clock
        self._cond = threading.Condition()
        self.state = CLOSED
        self.consecutive_failures = 0
        self.last_error = ""
        self.opened_at: float | None = None    # wall-clock time, for operators
        self._opened_mono = 0.0
        self._closed_mono: float | None = None
        self._min_open_s = 0.0                  # grows while the breaker flaps
        self.times_opened = 0
        self.probes = 0

    # -- the request path ----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    def wait_closed(self, timeout: float) -> bool:
        """Block while the breaker is open, up to `timeout` seconds or a worker shutdown.
        True when requests may be sent."""
        if self.state == CLOSED:
            return True
        deadline = self._clock() + timeout
        with self._cond:
            while self.state != CLOSED and not self._shutdown.requested():
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 1.0))
            return self.state == CLOSED and not self._shutdown.requested()

    def record_success(self) -> None:
        if self.consecutive_failures:
            with self._cond:
                self.consecutive_failures = 0

    def record_failure(self, error: str) -> None:
        with self._cond:
            self.consecutive_failures += 1
            self.last_error = error[:500]
            opened = self.state == CLOSED and self.consecutive_failures >= self.threshold
            if opened:
                self._open()
        if opened:
            self._changed()

    # -- state changes -------------------------------------------------------------------------

    def _open(self) -> None:  # with self._cond held
        now = self._clock()
        if self._closed_mono is not None and now - self._closed_mono < 2 * self.probe_cap_s:
            # Opened again soon after closing: /health says yes, requests say no.
            self._min_open_s = min(max(2 * self._min_open_s, self.probe_base_s * 4), 600.0)
        else:
            self._min_open_s = 0.0
        self.state = OPEN
        self.opened_at = time.time()
        self._opened_mono = now
        self.times_opened += 1
        log.warning("%s: circuit open after %d consecutive transient failures (last: %s); no "
                    "requests until /health answers 200 %d times in a row%s", self.name,
                    self.consecutive_failures, self.last_error, self.close_after,
                    f" and at least {self._min_open_s:.0f}s have passed" if self._min_open_s else "")
        threading.Thread(target=self._probe_loop, name=f"breaker-{self.name}", daemon=True).start()

    def _close(self) -> None:
        with self._cond:
            if self.state == CLOSED:
                return
            self.state = CLOSED
            self.consecutive_failures = 0
            self._closed_mono = self._clock()
            open_for = self._closed_mono - self._opened_mono
            self._cond.notify_all()
        log.warning("%s: circuit closed, server healthy again after %.0fs", self.name, open_for)
        self._changed()

    def _probe_loop(self) -> None:
        delay = self.probe_base_s
        healthy = 0
        while not self._shutdown.requested():
            if self._shutdown.wait(delay):
                return
            self.probes += 1
            try:
                ok = bool(self._probe())
            except Exception:  # a probe that raises is a failed probe
                ok = False
            if ok:
                healthy += 1
                delay = self.probe_base_s
                open_for = self._clock() - self._opened_mono
                if healthy >= self.close_after and open_for >= self._min_open_s:
                    self._close()
                    return
            else:
                healthy = 0
                delay = min(self.probe_cap_s, delay * 2)

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change(self)
            except Exception:
                log.debug("%s: could not publish the breaker state", self.name, exc_info=True)

    def snapshot(self) -> dict:
        return {"state": self.state, "consecutive_failures": self.consecutive_failures,
                "last_error": self.last_error, "opened_at": self.opened_at,
                "times_opened": self.times_opened, "probes": self.probes}


# -- its state in Redis, for `manage.py failed` ----------------------------------------------

def publisher(r: redis.Redis, gpu: str, url: str) -> Callable[[CircuitBreaker], None]:
    def publish(b: CircuitBreaker) -> None:
        r.hset(BREAKERS, queue_for(gpu), json.dumps({
            **b.snapshot(), "url": redact_url(url), "host": socket.gethostname(),
            "pid": os.getpid(), "at": time.time()}))
    return publish


def publish_closed(r: redis.Redis, gpu: str, url: str) -> None:
    """A worker starting on a healthy server clears what a dead predecessor left behind."""
    try:
        publisher(r, gpu, url)(CircuitBreaker(gpu, lambda: True))
    except Exception:
        log.debug("could not publish the breaker state of %s", gpu, exc_info=True)
