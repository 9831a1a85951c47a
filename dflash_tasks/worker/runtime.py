"""What a worker process holds across its tasks, in one object: one SGLang client and one circuit
breaker per server (shared by all its threads), the heartbeat and /metrics sampler threads of its
GPUs, whether its prompt storage is failing, and its shutdown state. Celery's signals reach it through hooks.py; tasks through
`runtime()`. Nothing else in the worker keeps state between tasks."""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from functools import lru_cache, partial

import redis

from dflash_tasks.core.connections import redis_client
from dflash_tasks.core.keys import GpuName
from dflash_tasks.core.settings import Settings, get_settings, redact_url
from dflash_tasks.ledger import ledger_for
from dflash_tasks.sglang import SGLangClient
from dflash_tasks.worker import heartbeat, migration, server_metrics
from dflash_tasks.worker.breaker import CircuitBreaker, publisher
from dflash_tasks.worker.shutdown import Shutdown

log = logging.getLogger(__name__)
# Connections to a server beyond the worker's threads: its breaker's /health probes share the
# client, and must not wait behind requests that hold every connection for minutes.
POOL_MARGIN = 4


class OutageLog:
    """Whether a failure, or a success, of something every thread of the worker uses is news:
    the first failure after a success, and the first success after failures, are worth a
    warning; the hundreds of threads failing in between are not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures = 0
        self._since = 0.0

    def failed(self) -> bool:
        """Count a failure; True for the first one of an outage."""
        with self._lock:
            self._failures += 1
            if self._failures == 1:
                self._since = time.monotonic()
            return self._failures == 1

    def lasted_s(self) -> float:
        """How long the outage under way has lasted; 0 when there is none."""
        with self._lock:
            return time.monotonic() - self._since if self._failures else 0.0

    def succeeded(self) -> tuple[int, float] | None:
        """(failures, seconds) of the outage this success ends; None when there was none."""
        with self._lock:
            if not self._failures:
                return None
            ended, self._failures = (self._failures, time.monotonic() - self._since), 0
            return ended


class WorkerRuntime:
    def __init__(self, settings: Settings, r: redis.Redis):
        self.settings = settings
        self.r = r
        self.book = ledger_for(r, settings)
        self.shutdown = Shutdown()
        self._lock = threading.Lock()
        self._clients: dict[str, SGLangClient] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        self._reporting: dict[str, threading.Event] = {}  # gpu -> stops its reporting threads
        self._registrations: dict[str, str] = {}  # gpu -> this worker's registration JSON
        self.concurrency: int | None = None  # the Celery pool's threads, once the worker knows
        self.prompt_storage = OutageLog()  # reads of prompt texts kept on storage (generate.py)

    def pool_size(self) -> int:
        """Connections per server: one for each of the worker's threads (all of them may be
        calling one server: a worker with 320 threads for 256 slots needs 320, not a fixed cap),
        plus the probes' margin; SGLangClient's default before the concurrency is known."""
        if self.concurrency is None:
            return SGLangClient.max_connections
        return self.concurrency + POOL_MARGIN

    def client(self, gpu: GpuName) -> SGLangClient:
        """The process's one client for gpu's server."""
        s = self.settings
        url = s.sglang_url_for(gpu)
        with self._lock:
            if url not in self._clients:
                self._clients[url] = SGLangClient(
                    url, connect_timeout_s=s.connect_timeout_s,
                    request_timeout_s=s.request_timeout_s, keepalive_expiry_s=s.keepalive_expiry_s,
                    max_connections=self.pool_size())
            return self._clients[url]

    def breaker(self, gpu: GpuName) -> CircuitBreaker:
        """The process's one breaker in front of gpu's server, its state published in Redis."""
        client = self.client(gpu)
        url, s = client.base_url, self.settings
        with self._lock:
            if url not in self._breakers:
                self._breakers[url] = CircuitBreaker(
                    f"{gpu} {redact_url(url)}", client.healthy, threshold=s.breaker_threshold,
                    close_after=s.breaker_close_after, probe_base_s=s.breaker_probe_base_s,
                    probe_cap_s=s.breaker_probe_cap_s, on_change=publisher(self.r, gpu, url),
                    shutdown=self.shutdown)
            return self._breakers[url]

    def start_reporting(self, gpu: GpuName, registration: str) -> None:
        """gpu's heartbeat (progress.json's "alive", and this worker's claim of the GPU's name:
        heartbeat.py) and its server's /metrics samples, each from a daemon thread; once per
        GPU."""
        with self._lock:
            if gpu in self._reporting:
                return
            stop = self._reporting[gpu] = threading.Event()
            self._registrations[gpu] = registration
        s = self.settings
        threading.Thread(target=heartbeat.run,
                         args=(self.book, gpu, registration, s.worker_heartbeat_s, stop,
                               partial(self._taken_over, gpu)),
                         name=f"heartbeat {gpu}", daemon=True).start()
        threading.Thread(target=migration.run, args=(self.book, gpu, self.shutdown, stop),
                         name=f"migrations {gpu}", daemon=True).start()
        threading.Thread(target=server_metrics.run,
                         args=(self.r, gpu, SGLangClient(s.sglang_url_for(gpu)),
                               s.server_metrics_interval_s, stop),
                         name=f"server metrics {gpu}", daemon=True).start()

    def _taken_over(self, gpu: GpuName, holder: str) -> None:
        """Another worker holds this GPU's name now (this process stood still longer than a
        fresh heartbeat): two consumers of one queue hand back each other's prompts, so this one
        stops, warmly (SIGTERM: its requests finish or go back to the queue)."""
        found = json.loads(holder)
        log.critical("%s: the worker on host %s (pid %s) holds this GPU's name now; this worker "
                     "stops (give each node its own DFLASH_NODE)", gpu, found.get("host"),
                     found.get("pid"))
        os.kill(os.getpid(), signal.SIGTERM)

    def stop_reporting(self) -> None:
        """A clean stop: the threads end and the heartbeats are removed (the GPUs read as not
        alive at once)."""
        with self._lock:
            stopped = list(self._reporting.items())
            self._reporting.clear()
            registrations, self._registrations = self._registrations, {}
        for _, stop in stopped:
            stop.set()
        heartbeat.clear(self.book, registrations)


@lru_cache(maxsize=1)
def runtime() -> WorkerRuntime:
    """The process's worker runtime, made at first use."""
    return WorkerRuntime(get_settings(), redis_client())
