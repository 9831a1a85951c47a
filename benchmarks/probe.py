"""Times the operator's reads of a job, in a process of their own (settings come from the
environment): `manage.py status --json` run in-process, progress.snapshot (what status and
progress.json print) and beat's whole tick for the job (seal, prune, write progress.json).

    DFLASH_REDIS_URL=... DFLASH_OUTPUT_DIR=... python -m benchmarks.probe --job NAME

Prints {"status_ms": median, "snapshot_ms": ..., "tick_ms": ...} (medians of --repeat calls,
after one warm-up call each, so imports are not counted).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()

    from click.testing import CliRunner

    from dflash_tasks.cli import cli
    from dflash_tasks.core.connections import redis_client
    from dflash_tasks.core.keys import JobName
    from dflash_tasks.core.settings import get_settings
    from dflash_tasks.output.progress import snapshot
    from dflash_tasks.tasks.control import tick_job

    r, s = redis_client(), get_settings()
    job = JobName(args.job)
    runner = CliRunner()

    def status() -> None:
        result = runner.invoke(cli, ["status", "--job", args.job, "--json"])
        assert result.exit_code == 0, result.output
        json.loads(result.output)

    def tick_ms() -> float:
        """Median of `repeat` whole ticks. Beat's own tick may hold the job's lock (a running
        deployment): a call that skipped measured nothing, so it is made again, untimed."""
        times, deadline = [], time.monotonic() + 60
        while len(times) < args.repeat + 1 and time.monotonic() < deadline:
            t = time.perf_counter()
            ran = tick_job(job) is not None
            if ran:
                times.append((time.perf_counter() - t) * 1000)
            else:
                time.sleep(0.05)
        return statistics.median(times[1:] or times) if times else float("nan")

    out = {"status_ms": median_ms(status, args.repeat),
           "snapshot_ms": median_ms(lambda: snapshot(r, job, s), args.repeat),
           "tick_ms": tick_ms()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
