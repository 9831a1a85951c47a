"""`make readme-story`: runs the README's "Raising max tokens mid-run" story and writes what its
commands print into the README.

The commands are the README's own: every `console` block after a line
`<!-- output: tools/readme_story.py -->` is run in order, its `$ ` lines as a user types them, on a
deployment of this machine (a redis-server of its own, two simulated servers with their pinned
workers, and beat, as `make demo` has them). Each block's output lines are replaced by what its
commands printed, in a terminal 100 columns wide (the README's own width; tables are checked
at 80 by tests/test_first_hour.py). Before each block, the story waits until every job is finished
(all prompts done and every row sealed), as a user reading the text would.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_dev.local import LocalCluster, free_port, wait_until  # noqa: E402

README = ROOT / "README.md"
MARKER = "<!-- output: tools/readme_story.py -->"
SIM_ARGS = ["--slots", "40", "--decode-tps", "1000"]
GPUS = 2


def story_blocks(lines: list[str]) -> list[tuple[int, int]]:
    """(first body line, closing fence line) of every console block after the marker."""
    found = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        start = i + 1
        if start >= len(lines) or lines[start].strip() != "```console":
            raise SystemExit(f"README.md:{i + 1}: the marker must come right before a ```console block")
        end = next(j for j in range(start + 1, len(lines)) if lines[j].strip() == "```")
        found.append((start + 1, end))
    return found


def commands(body: list[str]) -> list[str]:
    return [line[2:] for line in body if line.startswith("$ ")]


class Story:
    def __init__(self, cluster: LocalCluster, work: Path):
        self.cluster = cluster
        for name in [k for k in cluster.env if k.startswith("DFLASH_")]:
            del cluster.env[name]  # this machine's own deployment settings are not the story's
        bin_dir = str(Path(sys.executable).parent)  # manage.py as `source .venv/bin/activate` gives it
        cluster.env.update(COLUMNS="100", NO_COLOR="1", PATH=f"{bin_dir}:{cluster.env['PATH']}",
                           DFLASH_OUTPUT_DIR=str(work / "output"))
        cluster.env.pop("DFLASH_S3_URI", None)

    def start(self, work: Path) -> None:
        self.cluster.start_redis(free_port(), work / "redis")
        self.cluster.start_servers(GPUS, SIM_ARGS)
        self.cluster.start_workers()
        self.cluster.start_beat()

    def run(self, command: str) -> list[str]:
        done = subprocess.run(command, shell=True, cwd=ROOT, env=self.cluster.env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if done.returncode:
            raise SystemExit(f"`{command}` exited {done.returncode}:\n{done.stdout}")
        return [line.rstrip() for line in done.stdout.rstrip("\n").split("\n")]

    def finished(self, job: str) -> bool:
        status = subprocess.run(["manage.py", "status", "--job", job, "--json"], cwd=ROOT,
                                env=self.cluster.env, text=True, capture_output=True, check=True)
        snap = json.loads(status.stdout)
        return snap["status"] == "done" and snap["unsealed_rows"] == 0 and not snap["sealing_batch"]

    def settle(self, jobs: set[str]) -> None:
        for job in sorted(jobs):
            wait_until(lambda: self.finished(job), timeout=300, interval=1,
                       what=f"job {job} to finish")


def main() -> int:
    lines = README.read_text().split("\n")
    blocks = story_blocks(lines)
    if not blocks:
        raise SystemExit(f"README.md has no block after {MARKER}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dflash-story-") as tmp:
        work = Path(tmp)
        with LocalCluster(work / "logs") as cluster:
            story = Story(cluster, work)
            story.start(work)
            outputs, jobs = [], set()
            for first, end in blocks:
                story.settle(jobs)  # the jobs the commands so far have named
                printed = []
                for command in commands(lines[first:end]):
                    jobs.update(re.findall(r"--job[ =](\S+)", command))
                    print(f"$ {command}", flush=True)
                    out = story.run(command)
                    print("\n".join(out), flush=True)
                    printed += ([""] if printed else []) + [f"$ {command}", *out]
                outputs.append(printed)
    for (first, end), printed in reversed(list(zip(blocks, outputs))):
        lines[first:end] = printed
    README.write_text("\n".join(lines))
    print(f"README.md: {len(blocks)} blocks written in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
