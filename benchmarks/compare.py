"""`make bench-compare REV=<commit>`: makespan ratios of a change against the code before it, on
this machine, runs taking turns so both see the same load.

A speed goal of the form "cases 7 and 13 within 2% of the code before the change" cannot be read
off two RESULTS.md written on different days: the same code varies by about 4% between machines.
This builds REV in a git worktree with its own virtual environment (its own `make install`), then
runs `python -m benchmarks --cases N` there and here in turn, RUNS times each, and prints each
run's makespan / ideal, the means, and the change of the mean.

    .venv/bin/python -m benchmarks.compare --rev 6b98406 --cases 7,13 --runs 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ratio(results: dict, case: str) -> float:
    """The case's makespan / ideal as bench.py reports it (cases 1-3 and 7: the project's side
    of a run beside the baseline; 13: its own)."""
    figures = results[f"case{case}"]
    return float(figures["ours"]["ratio"] if "ours" in figures else figures["ratio"])


def run_case(tree: Path, case: str, out: Path) -> float:
    subprocess.run([str(tree / ".venv/bin/python"), "-m", "benchmarks", "--cases", case,
                    "--results", str(out)], cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return ratio(json.loads(out.with_suffix(".json").read_text()), case)


def worktree(rev: str, where: Path) -> Path:
    """REV checked out in `where`, with its own .venv (its code, its locked packages)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["make", "install"], cwd=where, check=True, stdout=subprocess.DEVNULL)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the commit to compare with (the code before)")
    ap.add_argument("--cases", default="7,13")
    ap.add_argument("--runs", type=int, default=3, help="runs of each case on each side")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    work = Path(tempfile.mkdtemp(prefix="dflash-compare-"))
    before = worktree(args.rev, work / "before")
    try:
        for case in cases:
            seen: dict[str, list[float]] = {"before": [], "after": []}
            for i in range(args.runs):
                for side, tree in (("before", before), ("after", ROOT)):
                    value = run_case(tree, case, work / f"{side}-{case}-{i}.md")
                    seen[side].append(value)
                    print(f"case {case} {side:6} run {i + 1}: {value:.3f}", flush=True)
            b, a = statistics.mean(seen["before"]), statistics.mean(seen["after"])
            print(f"case {case}: before {b:.3f} ({', '.join(f'{v:.3f}' for v in seen['before'])}), "
                  f"after {a:.3f} ({', '.join(f'{v:.3f}' for v in seen['after'])}): "
                  f"{(a / b - 1) * 100:+.1f}%", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)],
                       check=False)


if __name__ == "__main__":
    sys.exit(main())
