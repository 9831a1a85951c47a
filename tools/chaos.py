"""`make chaos SEED=… STEPS=… [MINUTES=…] [SKIP=kind,…]`: the long model-based chaos run.

Runs the sequence of SEED with STEPS steps; with MINUTES, goes on with SEED+1, SEED+2, … until
that much time has passed (a sequence started is finished). Stops at the first failure unless
--keep-going. Writes test-artifacts/chaos-report.md and .json: sequences run, steps by action,
faults injected, invariant checks made, prompts generated, any failure with its replay command.
Each sequence's processes and logs live under test-artifacts/chaos-work/seed-N, removed when the
sequence passes and kept when it fails.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from chaos import (  # noqa: E402
    BURST_WEIGHTS,
    WEIGHTS,
    ChaosConfig,
    Sequence,
    Stats,
    report_markdown,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--minutes", type=float, default=0.0,
                   help="keep running sequences (seed, seed+1, …) for this long")
    p.add_argument("--skip", default="", help="action kinds to leave out, comma-separated")
    p.add_argument("--converge-s", type=float, default=150.0)
    p.add_argument("--keep-going", action="store_true", help="go on after a failed sequence")
    p.add_argument("--concurrent", action="store_true",
                   help="bursts of commands at once, late duplicates, widened race windows")
    p.add_argument("--out", type=Path, default=ROOT / "test-artifacts")
    args = p.parse_args()

    skip = frozenset(k for k in args.skip.split(",") if k)
    unknown = skip - set(WEIGHTS) - set(BURST_WEIGHTS)
    if unknown:
        p.error(f"unknown action kinds {sorted(unknown)}; known: {sorted(WEIGHTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "chaos-work"
    stats = Stats()
    command = f"make chaos SEED={args.seed} STEPS={args.steps}" + (
        f" MINUTES={args.minutes:g}" if args.minutes else "") + (
        f" SKIP={args.skip}" if skip else "") + (" CONCURRENT=1" if args.concurrent else "")
    meta = {"command": command, "seed": args.seed, "steps": args.steps, "minutes": args.minutes,
            "skip": sorted(skip), "concurrent": args.concurrent}
    started = time.monotonic()
    seed = args.seed

    def write() -> None:
        seconds = time.monotonic() - started
        (args.out / "chaos-report.json").write_text(json.dumps(
            {**meta, "seconds": round(seconds, 1), **stats.as_dict()}, indent=1))
        (args.out / "chaos-report.md").write_text(report_markdown(stats, meta, seconds))

    while True:
        tmp = work / f"seed-{seed}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        cfg = ChaosConfig(seed=seed, steps=args.steps, skip=skip, converge_s=args.converge_s,
                          concurrent=args.concurrent)
        try:
            Sequence(tmp, cfg, stats, log=lambda line: print(line, flush=True)).run()
            shutil.rmtree(tmp, ignore_errors=True)
        except Exception:  # recorded in stats.failures with its replay command
            if not args.keep_going:
                write()
                break
        write()
        seed += 1
        if not args.minutes or time.monotonic() - started > args.minutes * 60:
            break
    print(f"\nreport: {args.out / 'chaos-report.md'}")
    print((args.out / "chaos-report.md").read_text())
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
