"""Where a process's CPU goes, measured in the run that reports it: py-spy samples the threads
of the process that hold the GIL (running Python, not waiting), without pausing it, and each
sample goes to the first part below that any frame of its stack belongs to."""
from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# (what, a frame belongs to it when its "function (file:line)" text contains one of these), in
# order: a sample counts for the first part its stack passes through, so the ledger's Redis
# calls count as the ledger, not as redis-py, and a log line written while Celery traces a task
# as the log line.
PARTS = [
    ("Celery events (worker heartbeats; task events only while Flower asks for them)",
     ("celery/events/",)),
    ("log lines", ("logging/__init__.py", "celery/utils/log.py")),
    ("the result backend (the stored summary)", ("celery/backends/",)),
    ("the ledger (task_state, complete.lua, take.lua top-ups)",
     ("dflash_tasks/ledger/", "dflash_tasks/dispatch/", "dflash_tasks/core/")),
    ("the HTTP request to the server (httpx)", ("httpx/", "httpcore/", "dflash_tasks/sglang/")),
    ("kombu acknowledging a message", ("basic_ack", "acknowledge (")),
    ("kombu receiving a message (BRPOP, the unacknowledged record, decoding)",
     ("kombu/", "dflash_tasks/worker/transport.py", "celery/worker/consumer/")),
    ("the project's task body and worker threads (the row, heartbeats, server metrics)",
     ("dflash_tasks/",)),
    ("Celery's pool, event loop and tracing", ("celery/", "billiard/", "vine/")),
]
OTHER = "everything else (the interpreter, threads, json)"


def py_spy() -> str | None:
    """The py-spy executable of this interpreter's environment (requirements.txt), if any."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen | None:
    """Start sampling `pid` for `seconds` into `out` (py-spy's raw, collapsed stacks); None
    when py-spy is missing. --nonblocking: the process is never paused, so it runs at its
    measured speed; a few samples are torn, which a share of thousands does not feel."""
    exe = py_spy()
    if not exe:
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", str(rate), "--format", "raw", "--nonblocking", "--gil",
                             "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def part_of(stack: str) -> str:
    for what, marks in PARTS:
        if any(m in stack for m in marks):
            return what
    return OTHER


def shares(raw: Path) -> tuple[dict[str, float], int]:
    """{part: share of the samples}, largest first, and the number of samples."""
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[part_of(stack)] += int(n)
    total = sum(counts.values())
    return ({what: n / total for what, n in counts.most_common()} if total else {}), total
