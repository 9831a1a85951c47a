"""A whole deployment on one machine, as real processes: Redis (if asked), simulated SGLang
servers, one pinned worker each, and beat. The demo and the benchmarks run on it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import redis

from dflash_tasks.core.keys import WORKERS

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], object], timeout: float = 60.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := check():
                return value
        except Exception:  # a service still starting refuses connections
            pass
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")


class LocalCluster:
    def __init__(self, logs: Path, env: dict[str, str] | None = None):
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.children: list[subprocess.Popen] = []
        self.named: dict[str, subprocess.Popen] = {}  # log name -> process (benchmarks read CPU times)
        self.server_urls: list[str] = []
        self._on_stop: list[Callable[[], object]] = []

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env,
                                start_new_session=True)
        self.children.append(proc)
        self.named[name] = proc
        return proc

    def start_redis(self, port: int, data_dir: Path, appendonly: bool = True) -> str:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.spawn("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(data_dir), "--save", "",
                             "--appendonly", "yes" if appendonly else "no"])
        url = f"redis://127.0.0.1:{port}/0"
        wait_for("redis-server", redis.Redis.from_url(url).ping)
        self.env["DFLASH_REDIS_URL"] = url
        return url

    def start_servers(self, n: int, sim_args: list[str], ports: list[int] | None = None,
                      extra_args: dict[int, list[str]] | None = None) -> list[str]:
        """n simulated servers with `sim_args`; `extra_args[i]` is added for server i only
        (e.g. a slower one). All are started before the first health wait."""
        first = len(self.server_urls)
        urls = []
        for i in range(n):
            gpu = first + i
            port = ports[i] if ports else free_port()
            self.spawn(f"sim{gpu}", [sys.executable, "manage.py", "sim-server", "--port", str(port),
                                     *sim_args, *(extra_args or {}).get(i, [])])
            urls.append(f"http://127.0.0.1:{port}")
        for gpu, url in enumerate(urls, first):
            wait_for(f"simulated server gpu{gpu}",
                     lambda: httpx.get(url + "/health").status_code == 200)
            self.server_urls.append(url)
        return self.server_urls

    def start_workers(self, concurrency: int | None = None) -> None:
        r = redis.Redis.from_url(self.env["DFLASH_REDIS_URL"])
        gpus = range(len(self.server_urls))
        r.hdel(WORKERS, *[f"gpu{gpu}" for gpu in gpus])
        extra = ["--concurrency", str(concurrency)] if concurrency else []
        for gpu, url in enumerate(self.server_urls):
            self.spawn(f"worker{gpu}", [sys.executable, "manage.py", "worker", "--gpu", str(gpu),
                                        "--sglang-url", url, *extra])
        for gpu in gpus:
            wait_for(f"worker gpu{gpu}", lambda: r.hexists(WORKERS, f"gpu{gpu}"))

    def start_beat(self) -> None:
        self.spawn("beat", [sys.executable, "manage.py", "beat"])

    def manage(self, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env,
                              check=True, capture_output=capture, text=True)

    def on_stop(self, cleanup: Callable[[], object]) -> None:
        """Run `cleanup` after every child has stopped (e.g. remove Redis's data)."""
        self._on_stop.append(cleanup)

    def stop(self) -> None:
        """Workers and beat first (a warm shutdown), then servers, Redis last."""
        for proc in reversed(self.children):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for cleanup in self._on_stop:
            cleanup()

    def __enter__(self) -> "LocalCluster":
        # Children run in sessions of their own (a terminal's Ctrl-C must not reach them before
        # the workers' orderly stop), so a SIGTERM to us must still stop them: make it an exit.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
