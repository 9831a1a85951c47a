"""Run an external trainer (SpecForge's CLI by default): its output streamed line by line to the
run's log file and to a tail the task publishes, stopped on request by signalling its whole
process group (torchrun's workers included)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TAIL_LINES = 40


@dataclass
class CommandResult:
    exit_code: int
    duration_s: float
    stopped: str | None  # why it was stopped ("cancel", "shutdown"), None when it ended itself


class LogTail:
    """Lines written to the log file, the last TAIL_LINES kept for the task's state."""

    def __init__(self, path: Path):
        self.path = path
        self.lines: deque[str] = deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)

    def write(self, line: str) -> None:
        line = line.rstrip("\n")
        with self._lock:
            self._file.write(line + "\n")
            self.lines.append(line)

    def tail(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def close(self) -> None:
        self._file.close()


def run_command(argv: list[str], *, cwd: Path, env: dict[str, str], log: LogTail,
                on_progress: Callable[[], None], should_stop: Callable[[], str | None],
                poll_s: float = 0.5, term_grace_s: float = 30.0) -> CommandResult:
    """Run `argv` to its end, or until `should_stop()` names a reason: then SIGTERM to its
    process group, SIGKILL after `term_grace_s`. `on_progress` is called every poll."""
    started = time.monotonic()
    log.write(f"$ {' '.join(argv)}")
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                errors="replace", start_new_session=True,
                                preexec_fn=_die_with_parent)
    except OSError as exc:
        log.write(f"could not start the trainer: {exc}")
        return CommandResult(127, time.monotonic() - started, None)

    def pump() -> None:
        for line in proc.stdout:
            log.write(line)

    reader = threading.Thread(target=pump, name="trainer-log", daemon=True)
    reader.start()
    stopped = None
    while proc.poll() is None:
        on_progress()
        if stopped is None and (stopped := should_stop()):
            log.write(f"stopping the trainer ({stopped}): SIGTERM to its process group")
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(term_grace_s)
            except subprocess.TimeoutExpired:
                log.write(f"the trainer did not stop within {term_grace_s:g}s: SIGKILL")
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            break
        try:
            proc.wait(poll_s)
        except subprocess.TimeoutExpired:
            pass
    reader.join(timeout=10)
    code = proc.returncode
    log.write(f"trainer exited with code {code} after {time.monotonic() - started:.1f}s")
    return CommandResult(code, time.monotonic() - started, stopped)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the thread that started it dies (the worker killed or
    OOM-killed), so a run queued again never finds the old trainer still holding the GPUs.
    The training worker's pool thread lives as long as the worker."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: its pgid is its pid
    except ProcessLookupError:
        pass
