"""The reference trainer on two processes (torchrun, gloo on CPU; issue 43, item 5): killed with
SIGKILL after a checkpoint and started again, it resumes from the newest checkpoint and trains
the losses and the weights of the run that was never interrupted, step for step; a checkpoint
is resumed only with the process count that wrote it."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, free_port, wait_until
from test_training_data import write_batches
from test_training_reference import row
from tiny_target import build_tiny_target

from dflash_dev.sim import tokens as sim

JOB, STEPS, EVERY = "ddp", 40, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target, 10 rows of random responses, and the run's config."""
    root = tmp_path_factory.mktemp("ddp")
    target = build_tiny_target(root / "target", layers=3)
    rng = random.Random(5)
    rows = []
    for i in range(10):
        prompt = sim.render_chat([{"role": "user", "content": f"w{i} w{2 * i}"}], True)
        rows.append(row(i, prompt, [sim.THINK] + [rng.randrange(sim.VOCAB) for _ in range(40)]))
    write_batches(root / "output", JOB, rows, per_batch=3)
    config = root / "train.toml"
    config.write_text(f'target_model = "{target}"\nblock_size = 4\ndrafter_layers = 1\n'
                      "anchors_per_sequence = 8\n"
                      f"learning_rate = 0.01\nbatch_size = 2\nshuffle_buffer = 4\n"
                      f"min_loss_tokens = 8\nmax_steps = {STEPS}\ncheckpoint_every = {EVERY}\n"
                      "keep_checkpoints = 2\nlog_every = 1\n")
    return root, config


def torchrun(setup, run_dir: Path, nproc: int = 2) -> subprocess.Popen:
    root, config = setup
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         f"--master_port={free_port()}", "-m", "dflash_tasks.training.reference",
         "--config", str(config), "--job", JOB, "--source", str(root / "output"),
         "--run-dir", str(run_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def result(out: str) -> dict:
    """Rank 0's last line: the run's outcome as JSON (torchrun's own lines go around it)."""
    return next(json.loads(line) for line in reversed(out.splitlines())
                if line.startswith('{"status"'))


def descendants(pid: int) -> list[int]:
    """pid's children, theirs, and so on (torchrun starts each worker in a session of its own,
    so killing torchrun's process group leaves them running)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += map(int, children)
        todo += map(int, children)
    return found


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss, the last line written for it (a resumed run writes a step again)."""
    return {m["step"]: m["loss"] for m in map(json.loads,
                                              (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_two_process_run_resumed_after_sigkill_trains_the_uninterrupted_losses(setup, tmp_path):
    from safetensors.torch import load_file

    whole = tmp_path / "whole"
    assert result(finished(torchrun(setup, whole))) == {
        "status": "done", "step": STEPS,
        "checkpoints": [str(whole / "checkpoints" / f"step_{s:08d}")
                        for s in range(EVERY, STEPS + 1, EVERY)]}

    split = tmp_path / "split"
    proc = torchrun(setup, split)
    checkpoints = split / "checkpoints"
    # killed once its first checkpoint is complete (renamed into place), wherever it is then
    wait_until(lambda: proc.poll() is not None or (checkpoints / f"step_{EVERY:08d}").is_dir(),
               timeout=300, interval=0.05, what="the first checkpoint")
    assert proc.poll() is None, proc.communicate()[0][-4000:]
    for pid in [proc.pid, *descendants(proc.pid)]:  # the node lost: torchrun and its workers
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    killed_at = max(int(p.name[5:]) for p in checkpoints.iterdir() if p.name.startswith("step_"))
    assert killed_at < STEPS, "the run ended before it was killed: nothing was resumed"

    out = finished(torchrun(setup, split))
    assert f"resumed from {checkpoints / f'step_{killed_at:08d}'}" in out, out[-3000:]
    assert result(out)["step"] == STEPS
    a, b = losses(whole), losses(split)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [b[s] for s in a] == [a[s] for s in a]  # the same floats, step for step
    last = f"step_{STEPS:08d}"
    left, right = (load_file(str(r / "checkpoints" / last / "drafter.safetensors"))
                   for r in (whole, split))
    assert all((left[k] == right[k]).all() for k in left)

    # two processes' checkpoint, one process: refused, saying with how many to resume
    more = setup[1].read_text().replace(f"max_steps = {STEPS}", f"max_steps = {STEPS + 4}")
    bigger = tmp_path / "more.toml"
    bigger.write_text(more)
    alone = subprocess.run([sys.executable, "-m", "dflash_tasks.training.reference", "--config",
                            str(bigger), "--job", JOB, "--source", str(setup[0] / "output"),
                            "--run-dir", str(split)], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 1 and "written by 2 process(es) and this run has 1: resume it " \
        "with --nproc_per_node 2" in alone.stderr, alone.stderr[-2000:]
