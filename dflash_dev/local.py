"""A whole deployment on one machine, as real processes: Redis (if asked), simulated SGLang
servers, one pinned worker each, beat, training workers. The one orchestrator of the demo, the
benchmarks, the README's story and the tests (tests/conftest.Cluster adds the tests' settings and
checks to it), with the helpers they share: free ports, waits with deadlines, child processes
whose output goes to a log and whose whole group is stopped."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx
import redis

from dflash_tasks.core.connections import connect
from dflash_tasks.core.keys import BREAKERS, WORKERS, GpuName
from dflash_tasks.core.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A port P with P..P+n-1 free, for a launcher that binds BASE+I itself later. Below the
    kernel's ephemeral range, where every outgoing connection takes a port: there, a port free
    now may be taken by a client before the server binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    for _ in range(200):
        base = random.randrange(10_000, low - n)
        if all(_bindable(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def wait_until(condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll `condition` until it returns something truthy; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # a service still starting refuses connections
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                       + (f" (last error: {last_error!r})" if last_error else ""))


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


class Proc:
    """A child process whose output goes to a log file, killed (with its group) on stop()."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path = ROOT):
        self.args = args
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                      cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group: no chance to clean up, as in a crash."""
        self._signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass


class LocalCluster:
    """Processes started here, stopped together (workers and beat first, Redis last). Servers,
    workers and beat are kept by GPU (`servers`, `workers`, `beat`); every child by its log name
    too (`named`: the benchmarks read their CPU times). Its GPUs are those of one node, `node`
    ("local" by default): GPU I is `gpu(I)`, "gpuI@local"."""

    def __init__(self, logs: Path, env: dict[str, str] | None = None, node: str = "local"):
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.node = node
        self.children: list[Proc] = []
        self.named: dict[str, Proc] = {}
        self.servers: dict[int, tuple[int, Proc]] = {}  # gpu -> (port, server)
        self.workers: dict[int, Proc] = {}
        self.beat: Proc | None = None
        self.train_workers: list[Proc] = []
        self._on_stop: list[Callable[[], object]] = []
        self._n = 0

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        """A child process, in the cluster's environment (or `env`), logging to its own file."""
        self._n += 1
        proc = Proc(args, self.logs / f"{self._n:02d}-{name}.log", env=env or self.env)
        self.children.append(proc)
        self.named[name] = proc
        return proc

    def start_redis(self, port: int, data_dir: Path, appendonly: bool = True) -> str:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.spawn("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(data_dir), "--save", "",
                             "--appendonly", "yes" if appendonly else "no"])
        url = f"redis://127.0.0.1:{port}/0"
        wait_until(redis.Redis.from_url(url).ping, what="redis-server")
        self.env["DFLASH_REDIS_URL"] = url
        return url

    def gpu(self, index: int) -> str:
        """The name of this node's GPU `index` (its queue, its worker, its key in progress.json)."""
        return GpuName.on(self.node, index)

    def _redis(self) -> redis.Redis:
        """A client of the deployment's Redis (its master, behind Sentinel), with the Redis
        settings its processes have."""
        return connect(Settings(**{name[len("DFLASH_"):].lower(): value
                                   for name, value in self.env.items()
                                   if name.startswith("DFLASH_REDIS_")}))

    # -- simulated servers ---------------------------------------------------------------------------

    def start_server(self, gpu: int, *args: str, port: int | None = None, wait: bool = True) -> int:
        """gpu's simulated server; returns its port."""
        port = port or free_port()
        proc = self.spawn(f"sim{gpu}", python("-m", "dflash_dev.sim", "--port", str(port), *args))
        self.servers[gpu] = (port, proc)
        if wait:
            self._wait_healthy(gpu)
        return port

    def start_servers(self, n: int, sim_args: list[str], ports: list[int] | None = None,
                      extra_args: dict[int, list[str]] | None = None) -> list[str]:
        """n more servers with `sim_args`; `extra_args[i]` is added for server i only (e.g. a
        slower one). All start before the first health wait. Returns every server's URL."""
        first = len(self.servers)
        for i in range(n):
            self.start_server(first + i, *sim_args, *(extra_args or {}).get(i, []),
                              port=ports[i] if ports else None, wait=False)
        for gpu in range(first, first + n):
            self._wait_healthy(gpu)
        return self.server_urls

    def _wait_healthy(self, gpu: int) -> None:
        url = self.url(gpu)
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout=30,
                   what=f"simulated server gpu{gpu} at {url}")

    def url(self, gpu: int) -> str:
        return f"http://127.0.0.1:{self.servers[gpu][0]}"

    @property
    def server_urls(self) -> list[str]:
        return [self.url(gpu) for gpu in sorted(self.servers)]

    # -- Celery ----------------------------------------------------------------------------------------

    def start_worker(self, gpu: int, *args: str, ready: bool = True) -> Proc:
        """gpu's worker, pinned to its server; returns once it has registered and, with
        `ready`, found its server healthy (a worker registers as soon as it starts)."""
        return self._await_registered(gpu, self._spawn_worker(gpu, args), ready=ready)

    def start_workers(self, concurrency: int | None = None) -> None:
        """A worker for every server, started together."""
        extra = ("--concurrency", str(concurrency)) if concurrency else ()
        started = {gpu: self._spawn_worker(gpu, extra) for gpu in sorted(self.servers)}
        for gpu, proc in started.items():
            self._await_registered(gpu, proc)

    def _spawn_worker(self, gpu: int, args) -> Proc:
        self._redis().hdel(WORKERS, self.gpu(gpu))  # a registration left by an earlier worker
        return self.spawn(f"worker{gpu}", python("manage.py", "worker", "--gpu", str(gpu),
                                                 "--node", self.node, "--sglang-url",
                                                 self.url(gpu), *args))

    def _await_registered(self, gpu: int, proc: Proc, ready: bool = True) -> Proc:
        r = self._redis()

        def registered() -> bool:
            raw = r.hget(WORKERS, self.gpu(gpu))
            if raw is None:
                return False
            # Ready: Celery runs (the worker command registers with no concurrency while it
            # waits for its server) and its server answered.
            state = r.hget(BREAKERS, self.gpu(gpu)) or b""
            return not ready or (json.loads(raw).get("concurrency", 0) > 0
                                 and b"waiting_for_server" not in state)

        wait_until(lambda: registered() or not proc.alive(), timeout=60,
                   what=f"worker {self.gpu(gpu)} to register")
        if not proc.alive():
            raise RuntimeError(f"worker {self.gpu(gpu)} exited:\n{proc.log()[-3000:]}")
        self.workers[gpu] = proc
        return proc

    def start_train_worker(self) -> Proc:
        """The training worker (`worker --queue train`); ready once Celery says so in its log."""
        proc = self._ready(self.spawn("train-worker", python("manage.py", "worker", "--queue",
                                                             "train")), "the training worker")
        self.train_workers.append(proc)
        return proc

    def start_beat(self) -> Proc:
        """Beat and its control worker; returns once that worker is ready, so what is enqueued
        next sees ticks from the start (on a loaded machine start-up takes seconds)."""
        self.beat = self._ready(self.spawn("beat", python("manage.py", "beat")),
                                "beat's control worker")
        return self.beat

    @staticmethod
    def _ready(proc: Proc, what: str) -> Proc:
        wait_until(lambda: "ready." in proc.log() or not proc.alive(), timeout=60,
                   what=f"{what} to start")
        if not proc.alive():
            raise RuntimeError(f"{what} exited:\n{proc.log()[-3000:]}")
        return proc

    def manage(self, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
        """manage.py's result; a failure raises with what it printed (captured or not)."""
        done = subprocess.run(python("manage.py", *args), cwd=ROOT, env=self.env,
                              capture_output=capture, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} exited {done.returncode}:\n"
                               f"{(done.stdout or '')[-2000:]}{(done.stderr or '')[-3000:]}")
        return done

    # -- the end ---------------------------------------------------------------------------------------

    def on_stop(self, cleanup: Callable[[], object]) -> None:
        """Run `cleanup` after every child has stopped (e.g. remove Redis's data)."""
        self._on_stop.append(cleanup)

    def stop(self) -> None:
        """The newest first: workers and beat (a warm shutdown), then servers, Redis last."""
        for proc in reversed(self.children):
            proc.stop(timeout=30)
        for cleanup in self._on_stop:
            cleanup()

    def __enter__(self) -> "LocalCluster":
        # Children run in sessions of their own (a terminal's Ctrl-C must not reach them before
        # the workers' orderly stop), so a SIGTERM to us must still stop them: make it an exit.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
