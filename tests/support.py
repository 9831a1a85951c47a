"""Process and synchronisation helpers shared by the tests: real subprocesses, waits with deadlines."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


class AofRedis:
    """A redis-server of the test's own with append-only persistence, on a fixed port and
    directory, so it can be crashed (SIGKILL) and started again on the same data, as a Redis
    restart in production. appendfsync: "everysec" is the deployed setting (docker-compose); a
    crash can lose the last second of writes. "always" loses nothing acknowledged."""

    def __init__(self, tmp: Path, appendfsync: str = "always"):
        import redis

        self.port = free_port()
        self.dir = tmp / "redis-aof"
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.appendfsync = appendfsync
        self.proc: Proc | None = None
        self.starts = 0
        self._client = redis.Redis.from_url(self.url)

    def start(self) -> None:
        self.starts += 1
        self.proc = Proc(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                          "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "",
                          "--maxmemory-policy", "noeviction", "--dir", str(self.dir)],
                         self.dir / f"redis-{self.starts}.log")
        wait_until(lambda: self._client.ping(), timeout=30, what="redis-server to load its AOF")

    def crash(self) -> None:
        """SIGKILL: no shutdown save, nothing flushed beyond what AOF already fsynced."""
        assert self.proc is not None
        self.proc._signal(signal.SIGKILL)
        self.proc.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
