"""Helpers shared by the tests: those of dflash_dev.local (real subprocesses, waits with
deadlines), and a Redis of a test's own that can be crashed and restarted on its data."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from dflash_dev.local import Proc, free_port, python, wait_until  # noqa: F401  (the tests' names)

ROOT = Path(__file__).resolve().parent.parent


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


# -- hints: a command the CLI prints for the operator to run -------------------------------------

HINT = re.compile(r"`(manage\.py [^`]+)`")
LONG_RUNNING = ("worker", "beat")  # they run until stopped: pasted as far as their --help


def hints_in(text: str) -> list[str]:
    """Every command hint in what a command printed (each in backticks), its lines joined as a
    terminal wraps them."""
    return HINT.findall(" ".join(text.split()))


def paste(hint: str, env: dict, cwd: Path, answer: str = "y\n") -> subprocess.CompletedProcess:
    """Run a hint as an operator pastes it: in the documented shell (`source .venv/bin/activate`
    puts manage.py on the PATH), from `cwd` (not the repository). A confirmation is answered
    with `answer`."""
    argv = shlex.split(hint)
    if argv[1] in LONG_RUNNING:
        argv.append("--help")
    return subprocess.run(argv, cwd=cwd, input=answer, capture_output=True, text=True,
                          timeout=120, env={**env, "PATH": f"{Path(sys.executable).parent}"
                                                           f"{os.pathsep}{env['PATH']}"})
