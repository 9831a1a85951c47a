"""A drafter you can trust, on CPU with a tiny random Qwen3 target: tau's definition on hand-made
drafts; the overfit gate passing on the reference trainer and catching a label shifted by one;
`manage.py train --smoke`; `manage.py train-eval` on a checkpoint and on a run, and its refusals."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_training_data import write_batches
from test_training_reference import row
from tiny_target import build_tiny_target, one_torch_thread  # noqa: F401  (a fixture)

from dflash_dev.sim import tokens as sim
from dflash_tasks.core.keys import JobName
from dflash_tasks.training.reference import blocks as blocks_module
from dflash_tasks.training.reference import train, trainer
from dflash_tasks.training.reference.config import SmokeConfig, TrainConfig
from dflash_tasks.training.reference.smoke import smoke_gate
from dflash_tasks.training.reference.speculation import Acceptance, continuation, replay
from dflash_tasks.training.reference.target import load_target

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
JOB = "smk"
BLOCK = 4
SMOKE_STEPS = 100  # tau 4.0 of 4 after 100 steps on the seeds tried; 3.2 is needed


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("target"), layers=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory, target_dir) -> Path:
    """4 thinking-mode rows whose answers are the target's own greedy continuations."""
    target = load_target(target_dir)
    rng = random.Random(1)
    rows = []
    for i in range(4):
        words = " ".join(f"w{rng.randrange(sim.VOCAB)}" for _ in range(6))
        prompt = sim.render_chat([{"role": "user", "content": words}], True)
        rows.append(row(i, prompt, [sim.THINK, *continuation(target, prompt + [sim.THINK], 40)]))
    root = tmp_path_factory.mktemp("output")
    write_batches(root, JOB, rows, per_batch=2)
    return root


def config(target_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{
        "target_model": str(target_dir), "block_size": BLOCK, "anchors_per_sequence": 16,
        "drafter_layers": 1,
        "decay_gamma": 4.0, "learning_rate": 1e-2, "batch_size": 2, "min_loss_tokens": 8,
        "max_length": 512, **overrides})


# -- tau ------------------------------------------------------------------------------------------


def test_tau_counts_the_bonus_token_and_stops_at_the_end_of_the_answer():
    ids = list(range(100, 120))  # prompt 100..104, answer 105..119: its first token, from the
    start = 5                    # prefill, is the first anchor; 14 tokens come from steps

    perfect = replay(lambda p: ids[p + 1:p + BLOCK], ids, start, BLOCK)
    # anchors 5, 9, 13, 17: three drafts accepted + the bonus each time, until the last step,
    # whose two accepted drafts reach the answer's end: no bonus token after it
    assert (perfect.steps, perfect.tokens, perfect.accepted) == (4, 14, [4, 4, 3])
    assert perfect.tau == 3.5 and perfect.by_position() == [1.0, 1.0, 0.75]

    wrong = replay(lambda p: [0] * (BLOCK - 1), ids, start, BLOCK)
    assert (wrong.steps, wrong.tokens, wrong.tau) == (14, 14, 1.0)  # the bonus alone
    assert wrong.by_position() == [0.0, 0.0, 0.0]

    # the first draft right, the second wrong, the third right: acceptance stops at the first
    # miss (a longest prefix), so each step yields 2 tokens; position 3 counts as not accepted
    first_only = replay(lambda p: [ids[p + 1], 0, ids[p + 3] if p + 3 < len(ids) else 0],
                        ids, start, BLOCK)
    assert (first_only.steps, first_only.tokens) == (7, 14)
    assert first_only.by_position() == [1.0, 0.0, 0.0]
    # away from the end, tau = 1 + the sum of the acceptances by position
    assert first_only.tau == 1 + sum(first_only.by_position())

    pooled = Acceptance(BLOCK).merge(perfect).merge(wrong)
    assert pooled.tau == 28 / 18  # pooled over steps, not a mean of the prompts' taus


# -- the overfit gate ------------------------------------------------------------------------------


def test_the_smoke_gate_passes_on_the_reference_trainer(tmp_path, target_dir, data):
    lines: list[str] = []
    verdict = smoke_gate(config(target_dir), SmokeConfig(rows=4, steps=SMOKE_STEPS), job=JOB,
                         source=data, work_dir=tmp_path, log=lines.append)
    assert verdict["passed"], verdict
    assert verdict["min_tau"] == 0.8 * BLOCK and verdict["tau"] >= 0.8 * BLOCK
    assert verdict["rows"] == 4 and verdict["steps"] == SMOKE_STEPS
    by_position = verdict["acceptance_by_position"]
    assert by_position == sorted(by_position, reverse=True)
    assert any("smoke gate passed" in line for line in lines)


def shifted_labels(real):
    """build_blocks with the classic off-by-one: block position k labelled x[a + k + 1]."""
    def build(*args, **kwargs):
        blocks = real(*args, **kwargs)
        size = kwargs["block_size"]
        labels = blocks.labels.view(blocks.labels.shape[0], -1, size).roll(-1, dims=-1)
        labels[..., -1] = blocks_module.IGNORE
        weights = blocks_module.decay_weights(size, kwargs["gamma"]) * \
            (labels != blocks_module.IGNORE)
        blocks.labels, blocks.weights = labels.flatten(1), weights.flatten(1)
        return blocks
    return build


def test_the_smoke_gate_catches_a_label_shifted_by_one(tmp_path, target_dir, data, monkeypatch):
    # The fault is injected by replacing the function that builds the labels, in this process
    # only (pytest undoes it): the trainer stays exactly the code that ships, with nothing in
    # its config or its code that could switch a fault on in a real run.
    monkeypatch.setattr(trainer, "build_blocks", shifted_labels(trainer.build_blocks))
    verdict = smoke_gate(config(target_dir), SmokeConfig(rows=4, steps=SMOKE_STEPS), job=JOB,
                         source=data, work_dir=tmp_path, log=lambda line: None)
    assert not verdict["passed"]
    # it learns its (wrong) labels, yet nothing it drafts is what the target produces
    assert verdict["tau"] < 1.2, verdict
    assert verdict["acceptance_by_position"][0] < 0.1


# -- the command line ----------------------------------------------------------------------


def manage(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def write_config(path: Path, target_dir: Path, extra: str = "") -> Path:
    path.write_text(f"""
[reference]
target_model = "{target_dir}"
block_size = {BLOCK}
drafter_layers = 1
anchors_per_sequence = 16
decay_gamma = 4.0
learning_rate = 1e-2
batch_size = 2
min_loss_tokens = 8
max_length = 512
{extra}""")
    return path


def test_train_smoke_runs_the_gate_here_and_fails_with_exit_1(tmp_path, target_dir, data):
    env = {"DFLASH_OUTPUT_DIR": str(data)}
    # one step cannot memorise anything: the gate fails, says why, and queues nothing
    cfg = write_config(tmp_path / "train.toml", target_dir, "[smoke]\nrows = 2\nsteps = 1\n")
    failed = manage("train", "--job", JOB, "--config", str(cfg), "--smoke", env=env)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "the smoke gate failed: tau" in failed.stderr and "label shift" in failed.stderr

    too_high = write_config(tmp_path / "high.toml", target_dir, "[smoke]\nmin_tau = 4.5\n")
    refused = manage("train", "--job", JOB, "--config", str(too_high), "--smoke", env=env)
    assert refused.returncode == 2 and "[smoke] min_tau: 4.5 is more than a block of 4" in \
        refused.stderr, refused.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, target_dir, data) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    result = train(config(target_dir, max_steps=40, checkpoint_every=40, log_every=40),
                   job=JOB, source=data, run_dir=run_dir, log=lambda line: None)
    return result.checkpoints[-1]


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"h{i}", "prompt": f"w{i} w{i * 7} w{i + 3}"}) + "\n"
                            for i in range(3)))
    return path


def test_train_eval_reports_tau_and_acceptance_by_position(tmp_path, checkpoint):
    prompts = write_prompts(tmp_path / "heldout.jsonl")
    out = tmp_path / "report.json"
    done = manage("train-eval", "--checkpoint", str(checkpoint), "--prompts", str(prompts),
                  "--max-new-tokens", "24", "--no-thinking", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tau" in done.stdout and "block position k" in done.stdout
    report = json.loads(out.read_text())
    assert report["checkpoint"] == str(checkpoint) and report["step"] == 40
    assert report["prompts"] == 3 and report["enable_thinking"] is False
    assert 1 <= report["tau"] <= BLOCK
    by_position = report["acceptance_by_position"]
    assert len(by_position) == BLOCK - 1 and by_position == sorted(by_position, reverse=True)
    # every token of every answer but its first (the prefill's) came from one step
    assert report["tokens"] == sum(p["answer_tokens"] - 1 for p in report["per_prompt"])
    # tau as z-lab's benchmark and SpecForge report it: the mean of the prompts' own; pooled
    # over every step beside it (issue 43, item 3)
    assert report["tau"] == pytest.approx(sum(p["tau"] for p in report["per_prompt"]) / 3)
    assert report["tau_pooled"] == pytest.approx(report["tokens"] / report["steps"])
    assert "pooled" in done.stdout


def test_train_eval_runs_under_the_lowest_transformers_declared(tmp_path, checkpoint):
    """Both ends of the declared range (issue 43, item 4): train-eval under the floor of
    pyproject.toml's `transformers>=` (requirements-lowest.txt, which make install puts beside
    .venv) measures what it measures under the pinned one. It read `out.cache`, which 4.x does
    not have, and loaded with `dtype=`, which 4.51 took for a config field."""
    import re
    import tomllib

    import transformers

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["training"]
    floor = next(re.fullmatch(r"transformers>=(\S+)", d).group(1) for d in declared
                 if d.startswith("transformers"))
    lowest = Path(sys.prefix) / "lowest-transformers"
    assert (lowest / "transformers").is_dir(), f"{lowest}: make install puts it there"
    env = {"PYTHONPATH": str(lowest)}
    version = subprocess.run([sys.executable, "-c", "import transformers; "
                              "print(transformers.__version__)"], capture_output=True, text=True,
                             env={**os.environ, **env}, check=True).stdout.strip()
    assert version == floor != transformers.__version__
    prompts = write_prompts(tmp_path / "heldout.jsonl")
    reports = {}
    for name, extra in (("lowest", env), ("pinned", {})):
        out = tmp_path / f"{name}.json"
        done = manage("train-eval", "--checkpoint", str(checkpoint), "--prompts", str(prompts),
                      "--max-new-tokens", "24", "--no-thinking", "--out", str(out), env=extra)
        assert done.returncode == 0, (name, done.stdout + done.stderr)
        reports[name] = json.loads(out.read_text())
    keys = ("tau", "tau_pooled", "steps", "tokens", "accepted")
    assert {k: reports["lowest"][k] for k in keys} == {k: reports["pinned"][k] for k in keys}


def test_train_eval_refuses_bad_input(tmp_path, checkpoint, redis_url):
    env = {"DFLASH_REDIS_URL": redis_url}
    prompts = write_prompts(tmp_path / "heldout.jsonl")
    unknown = manage("train-eval", "--run", "nope-train-1", "--prompts", str(prompts), env=env)
    assert unknown.returncode == 1 and "no training run named 'nope-train-1'" in unknown.stderr

    missing = manage("train-eval", "--checkpoint", str(tmp_path / "step_00000001"),
                     "--prompts", str(prompts))
    assert missing.returncode == 2 and "is not a reference checkpoint directory" in \
        missing.stderr, missing.stderr

    no_prompts = manage("train-eval", "--checkpoint", str(checkpoint))
    assert no_prompts.returncode == 2 and "no held-out prompts" in no_prompts.stderr

    absent = manage("train-eval", "--checkpoint", str(checkpoint), "--prompts",
                    str(tmp_path / "absent.jsonl"))
    assert absent.returncode == 1 and "absent.jsonl is not a file" in absent.stderr
    assert not (checkpoint / "eval.json").exists()  # nothing measured, nothing written


def test_train_eval_of_a_run_checks_the_thinking_mode_of_its_rows(tmp_path, checkpoint, data,
                                                                 redis_url, target_dir):
    import redis

    from dflash_tasks.training.queue import runs

    r = redis.Redis.from_url(redis_url)
    run = runs.create(r, JobName(JOB), "reference", {"trainer": "reference",
                                            "reference": {"target_model": str(target_dir)},
                                            "eval": {"prompts": str(write_prompts(
                                                tmp_path / "heldout.jsonl")),
                                                "max_new_tokens": 16}},
                      trigger="now")
    runs.update(r, run.name, status=runs.DONE, run_dir=str(checkpoint.parent.parent))
    env = {"DFLASH_REDIS_URL": redis_url, "DFLASH_OUTPUT_DIR": str(data)}
    # the rows are thinking-mode answers: tau in the other mode would not be about them
    refused = manage("train-eval", "--run", run.name, "--no-thinking", env=env)
    assert refused.returncode == 1, refused.stderr
    assert "enable_thinking=false, the run's rows are thinking" in refused.stderr

    # a held-out prompt that is one of the job's (its rows' user turn is "w1 w2"): refused, the
    # drafter has seen the target's answer to it (issue 43, item 3)
    leaked = tmp_path / "leaked.jsonl"
    leaked.write_text(write_prompts(tmp_path / "more.jsonl").read_text()
                      + json.dumps({"id": "h-leak", "prompt": "w1 w2"}) + "\n")
    refused = manage("train-eval", "--run", run.name, "--prompts", str(leaked), env=env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "1 of the 4 held-out prompts are prompts of the training job: h-leak (row g00" in \
        refused.stderr and "memorisation" in refused.stderr, refused.stderr

    out = tmp_path / "run-report.json"
    done = manage("train-eval", "--run", run.name, "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["enable_thinking"] is True and report["step"] == 40  # the rows' mode
    status = manage("train-status", "--run", run.name, env=env)
    assert "eval step_00000040" in status.stdout and f"tau {report['tau']:.2f}" in status.stdout


# -- through the queue ----------------------------------------------------------------------


def test_the_training_worker_runs_the_smoke_gate_first_and_evaluates_every_checkpoint(
        cluster, tmp_path, target_dir, data):
    from test_train_queue import queue_run, run_status, wait_run

    c = cluster()
    write_batches(c.output_dir, JOB, [json.loads(line) for line in _rows(data)], per_batch=2)
    # a job from another deployment, done: the trainer reads its rows epoch after epoch
    # instead of following it for more
    (c.output_dir / JOB / "progress.json").write_text(json.dumps({"job": JOB, "status": "done"}))
    c.start_train_worker()
    prompts = write_prompts(tmp_path / "heldout.jsonl")
    train_steps = "max_steps = 20\ncheckpoint_every = 10\nlog_every = 10\n"

    # [eval] holding one of the job's prompts: its quality gate refuses the run (issue 43)
    leaked = tmp_path / "leaked.jsonl"
    leaked.write_text(json.dumps({"id": "h-leak", "prompt": "w1 w2"}) + "\n")
    run = queue_run(c, "--job", JOB, "--config", str(write_config(
        tmp_path / "leak.toml", target_dir, train_steps + f'[eval]\nprompts = "{leaked}"\n')))
    refused = wait_run(c, run, ("done", "failed", "refused", "cancelled"), timeout=300)
    assert refused["status"] == "refused", refused
    assert any(f.startswith("held-out prompts in the training job: 1 of the [eval] prompts")
               and "h-leak (row g00" in f for f in refused["gate"]["failures"]), refused["gate"]

    # a gate no drafter passes in one step: the run fails before it trains, saying why
    failing = write_config(tmp_path / "fail.toml", target_dir,
                           train_steps + "[smoke]\nrows = 2\nsteps = 1\nmin_tau = 4\n")
    run = queue_run(c, "--job", JOB, "--config", str(failing))
    failed = wait_run(c, run, ("done", "failed", "refused", "cancelled"), timeout=300)
    assert failed["status"] == "failed" and failed["error"].startswith("the smoke gate failed: tau")
    assert failed["smoke"]["passed"] is False and failed["smoke"]["steps"] == 1
    assert not failed.get("checkpoints") and not (Path(failed["run_dir"]) / "checkpoints").exists()
    assert "smoke gate FAILED" in c.manage("train-status", "--run", run).stdout

    passing = write_config(tmp_path / "pass.toml", target_dir, train_steps + f"""
[smoke]
rows = 4
steps = {SMOKE_STEPS}
[eval]
prompts = "{prompts}"
max_prompts = 2
max_new_tokens = 16
""")
    run = queue_run(c, "--job", JOB, "--config", str(passing))
    done = wait_run(c, run, ("done", "failed", "refused", "cancelled"), timeout=600)
    assert done["status"] == "done", done
    assert done["smoke"]["passed"] and done["smoke"]["tau"] >= 0.8 * BLOCK
    evals = done["evals"]
    assert [Path(e["checkpoint"]).name for e in evals] == ["step_00000010", "step_00000020"]
    for e in evals:
        assert 1 <= e["tau"] <= BLOCK and e["prompts"] == 2 and e["enable_thinking"] is True
        assert (Path(e["checkpoint"]) / "eval.json").is_file()
    detail = c.manage("train-status", "--run", run).stdout
    assert "smoke gate" in detail and "passed: tau" in detail
    assert "eval step_00000020" in detail and f"tau {evals[-1]['tau']:.2f}" in detail
    assert run_status(c, run)["status"] == "done"


def _rows(root: Path) -> list[str]:
    """The data fixture's rows, as JSON lines, to ship again into the cluster's storage."""
    from dflash_tasks.output.batches import read_batch, read_manifest
    from dflash_tasks.output.storage import LocalStorage

    storage = LocalStorage(root)
    return [json.dumps(r) for rec in read_manifest(storage, JOB)["batches"]
            for r in read_batch(storage, rec)]
