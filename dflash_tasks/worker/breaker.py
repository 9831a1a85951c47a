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

Two faults open it at once, because they are the deployment's and no prompt can succeed there
(sglang/errors.py's DeploymentError): what answers at the URL is not the SGLang it should be (a
404 on its own endpoints, 401/403 from a proxy, an unreadable /server_info, another model). Its
kind is then "misconfigured", and it closes only when the server's identity reads right again
(`identity_ok`, probed like /health), not on /health, which a wrong server may answer. And, as a
safety net, `threshold` consecutive permanent failures of one reason that are not known to be the
prompt's (a context too long for the cap is): kind "repeated_failure", which stays open until
the worker restarts, since no probe can tell a fixed server from a broken one.

A task may also `trip` it with a probe of its own, for a fault of this node that no prompt
caused: the prompts' texts kept on storage, not found or refused here (tasks/generate.py's
_read_body: kind "misconfigured"), or unreadable for longer than breaker_wait_s ("transient");
the probe reads them again.

While it is open the GPU takes no new work (take.lua), and beat hands its prompts to the job's
other GPUs (dispatch.unavailable_gpus): at once for the two kinds above, after
`breaker_handover_s` for a server that stopped answering.

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

from dflash_tasks.core.keys import BREAKERS, GpuName
from dflash_tasks.core.settings import redact_url
from dflash_tasks.worker.shutdown import Shutdown

log = logging.getLogger(__name__)

CLOSED, OPEN = "closed", "open"
# Why it is open: transient failures in a row, the deployment's fault, the same permanent
# failure in a row.
TRANSIENT, MISCONFIGURED, REPEATED_FAILURE = "transient", "misconfigured", "repeated_failure"


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
        self.kind = TRANSIENT
        self.consecutive_failures = 0
        self.same_failures = 0                  # consecutive permanent failures of one reason
        self._same_reason = ""
        self.last_error = ""
        self._active_probe: Callable[[], bool] | None = probe
        self._probing: str | None = None        # what a trip's own probe checks, for its logs
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
        if self.consecutive_failures or self.same_failures:
            with self._cond:
                self.consecutive_failures = 0
                self.same_failures = 0

    def record_failure(self, error: str) -> None:
        """A transient failure (the server did not answer)."""
        with self._cond:
            self.consecutive_failures += 1
            self.last_error = error[:500]
            opened = self.state == CLOSED and self.consecutive_failures >= self.threshold
            if opened:
                self._open(TRANSIENT, self._probe)
        if opened:
            self._changed()

    def record_permanent(self, reason: str, error: str) -> None:
        """A permanent failure that is not known to be the prompt's: the server answered, but
        `threshold` of them in a row, of one reason, is a server that answers everything so."""
        with self._cond:
            self.consecutive_failures = 0
            if reason != self._same_reason:
                self._same_reason, self.same_failures = reason, 0
            self.same_failures += 1
            opened = self.state == CLOSED and self.same_failures >= self.threshold
            if opened:
                self.last_error = (f"the last {self.same_failures} requests all failed with "
                                   f"{reason}: {error[:400]}")
                self._open(REPEATED_FAILURE, None)
        if opened:
            self._changed()

    def trip(self, reason: str, error: str, probe: Callable[[], bool], *,
             kind: str = MISCONFIGURED, probing: str | None = None) -> None:
        """Open now, until `probe` says the fault is gone: by default the deployment's fault
        (sglang.DeploymentError; the probe reads the server's identity), or `kind` TRANSIENT
        for an outage that lasted too long (the probe tries again what failed). `probing` names
        what the probe checks when it is not the server ("reads of the prompts' texts"), for
        the logs."""
        with self._cond:
            self.last_error = f"{reason}: {error[:480]}"
            opened = self.state == CLOSED
            if opened:
                self._open(kind, probe, probing)
        if opened:
            self._changed()

    # -- state changes -------------------------------------------------------------------------

    def _open(self, kind: str, probe: Callable[[], bool] | None,
              probing: str | None = None) -> None:  # with self._cond held
        now = self._clock()
        self.kind, self._active_probe, self._probing = kind, probe, probing
        if self._closed_mono is not None and now - self._closed_mono < 2 * self.probe_cap_s:
            # Opened again soon after closing: /health says yes, requests say no.
            self._min_open_s = min(max(2 * self._min_open_s, self.probe_base_s * 4), 600.0)
        else:
            self._min_open_s = 0.0
        self.state = OPEN
        self.opened_at = time.time()
        self._opened_mono = now
        self.times_opened += 1
        if probing is not None:
            log.error("%s: circuit open, %s: this GPU takes no work%s until %s work again",
                      self.name, self.last_error, "" if kind == TRANSIENT else
                      " and its prompts go to the other GPUs", probing)
        elif kind == TRANSIENT:
            log.warning("%s: circuit open after %d consecutive transient failures (last: %s); no "
                        "requests until /health answers 200 %d times in a row%s", self.name,
                        self.consecutive_failures, self.last_error, self.close_after,
                        f" and at least {self._min_open_s:.0f}s have passed" if self._min_open_s
                        else "")
        elif kind == MISCONFIGURED:
            log.error("%s: circuit open, the server is misconfigured (%s): this GPU takes no work "
                      "and its prompts go to the other GPUs until its /server_info and /v1/models "
                      "read right again", self.name, self.last_error)
        else:
            log.error("%s: circuit open, %s: this GPU takes no work and its prompts go to the "
                      "other GPUs; restart this worker once the server is fixed", self.name,
                      self.last_error)
        if probe is not None:
            threading.Thread(target=self._probe_loop, name=f"breaker-{self.name}",
                             daemon=True).start()

    def _close(self) -> None:
        with self._cond:
            if self.state == CLOSED:
                return
            self.state = CLOSED
            self.consecutive_failures = self.same_failures = 0
            self._closed_mono = self._clock()
            open_for = self._closed_mono - self._opened_mono
            self._cond.notify_all()
        log.warning("%s: circuit closed, %s again after %.0fs", self.name,
                    f"{self._probing} work" if self._probing else "server healthy", open_for)
        self._changed()

    def _probe_loop(self) -> None:
        delay = self.probe_base_s
        healthy = 0
        while not self._shutdown.requested():
            if self._shutdown.wait(delay):
                return
            self.probes += 1
            try:
                ok = bool(self._active_probe and self._active_probe())
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
        return {"state": self.state, "kind": self.kind,
                "consecutive_failures": self.consecutive_failures,
                "last_error": self.last_error, "opened_at": self.opened_at,
                "times_opened": self.times_opened, "probes": self.probes}


# -- its state in Redis, for `manage.py failed` ----------------------------------------------

def publisher(r: redis.Redis, gpu: GpuName, url: str) -> Callable[[CircuitBreaker], None]:
    def publish(b: CircuitBreaker) -> None:
        r.hset(BREAKERS, gpu, json.dumps({
            **b.snapshot(), "url": redact_url(url), "host": socket.gethostname(),
            "pid": os.getpid(), "at": time.time()}))
    return publish


def publish_waiting(r: redis.Redis, gpu: GpuName, url: str, kind: str, reason: str,
                    since: float) -> None:
    """A worker waiting for its server before it takes work, as an open breaker says it: no
    dispatch to its GPU (take.lua), and `status` shows it with `kind` ("waiting_for_server", or
    "misconfigured": the URL answers, but not as SGLang) and the reason."""
    try:
        r.hset(BREAKERS, gpu, json.dumps({
            "state": "open", "kind": kind, "consecutive_failures": 0, "last_error": reason,
            "opened_at": since, "times_opened": 0, "probes": 0, "url": redact_url(url),
            "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}))
    except Exception:
        log.debug("could not publish the state of %s", gpu, exc_info=True)


def publish_closed(r: redis.Redis, gpu: GpuName, url: str) -> None:
    """A worker starting on a healthy server clears what a dead predecessor left behind."""
    try:
        publisher(r, gpu, url)(CircuitBreaker(gpu, lambda: True))
    except Exception:
        log.debug("could not publish the breaker state of %s", gpu, exc_info=True)
